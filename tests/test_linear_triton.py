"""GPU linear weights in fp8 blocks and int4 groups: the Triton kernels against their torch reference (Triton's
interpreter on the CPU, the GPU where there is one), and `linear.triton` / `lm_head.triton` / `embedding.host` in a
loaded model against the reference operators."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glm5_offload.errors import Glm5Error
from glm5_offload.formats import fp8_blocks, int_groups
from glm5_offload.kernels import linear_triton
from glm5_offload.loader import load_model
from glm5_offload.ops import linear_triton as linear_ops
from glm5_offload.rules import load_rules
from glm5_offload.runtime.kv_cache import new_cache

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the output's rounding: one bf16 ulp of the largest value, in fp32 a few ulps of the sum
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-8}


def random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check(y, want, dtype):
    assert y.dtype == dtype and y.shape == want.shape
    err = (y.float().cpu() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * want.abs().max().item() * 4, err


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_the_reference(monkeypatch, M, dtype):
    """Partial 128-blocks at both edges (200 x 300); decode (M <= 32) and prefill tiles; one row with its loop
    pipelined (loop_stages, forced on this short loop) and not."""
    w8, scales = fp8_blocks.quantize(random((200, 300), M) * 0.05)
    x = random((M, 300), M + 1).to(dtype)
    monkeypatch.setitem(linear_triton.DECODE_TILE, "long_loop", 1)
    for loop_stages in (None, 3) if M == 1 else (None,):
        monkeypatch.setitem(linear_triton.DECODE_TILE, "loop_stages", loop_stages)
        y = linear_triton.fp8_linear(x.to(DEVICE), w8.to(DEVICE), scales.to(DEVICE), fp8_dot=False)
        check(y, linear_triton.linear_reference(x, "fp8", w8, scales), dtype)


def test_one_row_fp8_pipelines_only_long_loops(monkeypatch):
    """The shipped DECODE_TILE's loop_stages reach the kernel only for one row and a loop of long_loop iterations or
    more per program (32 blocks of inputs, `step` a loop, over 1, 2 or 4 programs)."""
    launches = []

    class Recorder:  # stands in for the kernel: records (splits, LOOP_STAGES) of each launch
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid[2], meta["LOOP_STAGES"]))

    monkeypatch.setattr(linear_triton, "_fp8_kernel", Recorder())
    tile = linear_triton.DECODE_TILE
    w8, scales = fp8_blocks.quantize(random((64, 32 * 128), 1))
    for programs in (1, 2, 4):
        monkeypatch.setattr(linear_triton, "programs_wanted", lambda device: programs)
        for rows in (1, 3):
            linear_triton.fp8_linear(random((rows, 32 * 128), 2), w8, scales)
    want = []
    for splits in (1, 2, 4):
        long = 32 // splits // tile["step"] >= tile["long_loop"]
        want += [(splits, tile["loop_stages"] if long else None), (splits, None)]  # one row, then three
    assert launches == want
    assert {stages for _, stages in want} == {tile["loop_stages"], None}  # both kinds of loop among these


def test_fp8_dot_quantises_the_activations_per_128_inputs():
    """The FP8-dot prefill path (native on sm89+, widened otherwise: the same products) equals the reference with the
    activations quantised as fp8_blocks.quantize_activations does, and stays near the unquantised product."""
    w8, scales = fp8_blocks.quantize(random((256, 384), 1))
    x = random((64, 384), 2).to(torch.bfloat16)
    y = linear_triton.fp8_linear(x.to(DEVICE), w8.to(DEVICE), scales.to(DEVICE), fp8_dot=True)
    check(y, linear_triton.linear_reference(x, "fp8", w8, scales, fp8_dot=True), torch.bfloat16)
    assert rel_err(y.float().cpu(), linear_triton.linear_reference(x, "fp8", w8, scales)) < 0.05
    x8, s = fp8_blocks.quantize_activations(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (64, 3)
    assert rel_err(fp8_blocks.dequantize_activations(x8, s), x.float()) < 0.05


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 7, 40])
def test_int4_linear_equals_the_reference(monkeypatch, M, group):
    """(One row: the GEMV kernel, with one group and with two a step.)"""
    values, scales = int_groups.quantize(random((130, 256), group), "int4", group)
    x = random((M, 256), M)
    w, s = torch.from_numpy(values), torch.from_numpy(scales)
    for step in (1, 2) if M == 1 else (1,):
        monkeypatch.setitem(linear_triton.INT4_GEMV_TILE, "step", step)
        for dtype in (torch.float32, torch.bfloat16):
            y = linear_triton.int4_linear(x.to(dtype).to(DEVICE), w.to(DEVICE), s.to(DEVICE), group)
            check(y, linear_triton.linear_reference(x.to(dtype), "int4", w, s, group), dtype)
    with pytest.raises(ValueError, match="group size 128 does not divide the 96 inputs"):
        linear_triton.int4_linear(x[:, :96], w[:, :48], s, 128)


@pytest.mark.parametrize("tile", [{}, {"step": 2}, {"step": 4, "vector": True}, {"vector": True},
                                  {"vector": True, "loop_stages": 3}])
def test_split_inputs_sum_in_a_fixed_order(monkeypatch, tile):
    """Decode splits the inputs over programs (forced here: the interpreter runs one); the tile's last program adds
    the partial sums up to the reference, and two calls give the same bits. Every decode tile: several 128-blocks
    (int4: groups) per step, the M = 1 vector form, more steps than a split holds."""
    monkeypatch.setattr(linear_triton, "programs_wanted", lambda device: 64)
    monkeypatch.setitem(linear_triton.DECODE_TILE, "step", tile.get("step", 1))
    monkeypatch.setitem(linear_triton.DECODE_TILE, "vector", tile.get("vector", False))
    monkeypatch.setitem(linear_triton.INT4_DECODE_TILE, "step", tile.get("step", 1))
    monkeypatch.setitem(linear_triton.DECODE_TILE, "loop_stages", tile.get("loop_stages"))
    monkeypatch.setitem(linear_triton.DECODE_TILE, "long_loop", 1)
    for rows in (1, 3):
        w8, scales = fp8_blocks.quantize(random((64, 1000), rows))
        x = random((rows, 1000), 4)
        y = linear_triton.fp8_linear(x.to(DEVICE), w8.to(DEVICE), scales.to(DEVICE))
        check(y, linear_triton.linear_reference(x, "fp8", w8, scales), torch.float32)
        assert torch.equal(y, linear_triton.fp8_linear(x.to(DEVICE), w8.to(DEVICE), scales.to(DEVICE)))
        values, s = int_groups.quantize(random((64, 1536), 5 + rows), "int4", 64)
        values, s = torch.from_numpy(values), torch.from_numpy(s)
        x = random((rows, 1536), 6)
        y = linear_triton.int4_linear(x.to(DEVICE), values.to(DEVICE), s.to(DEVICE), 64)
        check(y, linear_triton.linear_reference(x, "int4", values, s, 64), torch.float32)
        assert torch.equal(y, linear_triton.int4_linear(x.to(DEVICE), values.to(DEVICE), s.to(DEVICE), 64))
    assert not linear_triton._tile_counters(torch.device(DEVICE)).any()  # every counter left at zero


def test_activations_quantise_in_one_kernel_as_the_reference_does():
    """The prefill's FP8 activations (per row and 128 inputs; a partial block at the end, a zero block; blocks of
    huge, tiny and infinite values): the bytes and scales of fp8_blocks.quantize_activations, the scales column-major
    as cuBLAS takes them. On a GPU the division is a reciprocal and two FMAs: bit-exact all the same."""
    x = random((37, 300), 11) * torch.logspace(-3, 3, 300)
    x[5, 128:256] = 0
    x[6, :128] = (random((128,), 12) * 1e38).clamp(-3e38, 3e38)  # up to bf16's largest
    x[7, :128] *= 1e-14
    x[7, 0] = 1e30  # the scale 2e27: the rest's quotients below 2^-126
    x[8, 128:256] = 2.0 ** -133  # bf16 subnormals
    x[9, 3], x[9, 140], x[10, 290] = float("inf"), -float("inf"), float("inf")  # inf / inf: NaN, the rest of it 0
    x8, scales = linear_triton.quantize_activations(x.to(DEVICE, torch.bfloat16))
    want8, want_scales = fp8_blocks.quantize_activations(x.bfloat16())
    got, want = e4m3_bits(x8), e4m3_bits(want8)
    assert torch.equal(got, want), f"{(got != want).sum()} bytes differ, first at {(got != want).nonzero()[:4].tolist()}"
    assert torch.equal(scales.cpu(), want_scales) and scales.stride() == (1, 37)
    x8, scales = linear_triton.quantize_activations(x.to(DEVICE, torch.bfloat16), rows=40)  # 3 zero rows after
    assert torch.equal(e4m3_bits(x8[:37]), want) and not x8[37:].view(torch.uint8).any()
    assert torch.equal(scales[:37].cpu(), want_scales) and scales.stride() == (1, 40) and (scales[37:] > 0).all()


def e4m3_bits(x8: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes with NaN's sign cleared: inf / inf is a NaN of either sign (x86 makes it negative, a GPU
    positive), and no reader looks at it."""
    bits = x8.view(torch.uint8).cpu()
    return torch.where((bits & 0x7F) == 0x7F, 0x7F, bits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_gemvs_on_two_streams_at_once():
    """Split decode GEMVs queued on the side stream and on the current one at once (as a decode step's query runs
    beside its indexer, model/mla.py): each stream's tiles count their arrivals in counters of its own (with one
    set for both, a decode step of a GLM-5.2-shaped model on the H200 produced no usable token), and each result
    equals the GEMV's alone, bit for bit."""
    from glm5_offload.util import Beside

    device = torch.device("cuda")
    x = random((1, 2048), 1).to(device, torch.bfloat16)
    weights = [[t.to(device) for t in fp8_blocks.quantize(random((n, 2048), n))] for n in (16384, 8192)]
    want = [linear_triton.fp8_linear(x, *w) for w in weights]
    current = linear_triton._tile_counters(device)
    with Beside(device):
        assert linear_triton._tile_counters(device) is not current
    for _ in range(50):
        with Beside(device) as side:
            first = linear_triton.fp8_linear(x, *weights[0])
        second = linear_triton.fp8_linear(x, *weights[1])
        side.join()
        assert torch.equal(first, want[0]) and torch.equal(second, want[1])
    torch.cuda.synchronize()
    assert not linear_triton._tile_counters(device).any()


@pytest.mark.skipif(not torch.cuda.is_available() or not linear_triton.has_blockwise_fp8_mm(torch.device("cuda")),
                    reason="needs cuBLAS's blockwise FP8 GEMM (sm90)")
def test_cublas_blockwise_prefill_equals_the_reference():
    """Any number of tokens (cuBLAS refused those not a multiple of 4 with CUBLAS_STATUS_NOT_SUPPORTED: bench_flash's
    4K prefills stopped there)."""
    w8, scales = fp8_blocks.quantize(random((384, 512), 12))
    for M in (100, 33, 34, 35, 4095):
        x = random((M, 512), M).bfloat16()
        y = linear_triton.fp8_blockwise_linear(x.cuda(), w8.cuda(), scales.cuda())
        assert y.is_contiguous()
        check(y, linear_triton.linear_reference(x, "fp8", w8, scales, fp8_dot=True), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        linear_triton.fp8_blockwise_linear(x[:, :384].cuda(), w8[:, :384].cuda(), scales.cuda())


def test_cublas_blockwise_gets_rows_in_fours(monkeypatch):
    """What cuBLAS's blockwise GEMM is handed (here a stand-in computing it from the dequantised operands, on the
    CPU): a multiple of 4 rows, whatever the prefill's count, and the result cut back to it."""
    def blockwise_mm(x8, x_scales, weight, scales, dtype):
        assert x8.shape[0] % 4 == 0 and x_scales.shape == (x8.shape[0], 4) and x_scales.stride() == (1, x8.shape[0])
        x = fp8_blocks.dequantize_activations(x8.cpu(), x_scales.cpu())
        return (x @ fp8_blocks.dequantize(weight.cpu(), scales.cpu()).T).to(dtype)

    monkeypatch.setattr(linear_triton, "_blockwise_mm", blockwise_mm)
    w8, scales = fp8_blocks.quantize(random((256, 512), 14))
    for M in (33, 34, 35, 36):
        x = random((M, 512), M).bfloat16()
        y = linear_triton.fp8_blockwise_linear(x.to(DEVICE), w8.to(DEVICE), scales.to(DEVICE))
        assert y.shape == (M, 256)
        check(y, linear_triton.linear_reference(x, "fp8", w8, scales, fp8_dot=True), torch.bfloat16)


def test_every_e4m3_value_widens_exactly():
    """The kernels read FP8 as bytes and widen them by bit arithmetic (no FP8 hardware needed): all 254 finite
    e4m3 values, and a block scale, against torch's own conversion."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF are NaN
    w8 = codes.repeat(130, 1)[:, :200].contiguous().view(torch.float8_e4m3fn)  # 130 x 200: partial blocks
    scales = torch.tensor([[0.5, 3.0], [2.0**-10, 7.0]])
    out = linear_triton.fp8_dequantize(w8.to(DEVICE), scales.to(DEVICE), torch.float32).cpu()
    assert torch.equal(out, fp8_blocks.dequantize(w8, scales))


def test_quant_linear_module_and_its_cpu_path(monkeypatch):
    """QuantLinear through the kernels and, on a CPU without the interpreter, through the reference; dense_weight
    is the dequantised W (what absorbed MLA reads of kv_b_proj)."""
    w = random((96, 256), 6)
    x = random((3, 5, 256), 7)
    for fmt, group in (("fp8", 0), ("int4", 64)):
        arrays = linear_ops.convert(w, fmt, group)
        weight = torch.from_numpy(arrays["weight"])
        weight = weight.view(torch.float8_e4m3fn) if fmt == "fp8" else weight
        module = linear_ops.QuantLinear(fmt, group, weight, torch.from_numpy(arrays["scales"]), 256, torch.float32)
        want = x @ module.dense_weight().T
        assert rel_err(module.dense_weight(), w) < (0.05 if fmt == "fp8" else 0.15)
        assert rel_err(module(x), want) < 1e-5 and module(x).shape == (3, 5, 96)
        monkeypatch.setattr(linear_ops, "INTERPRET", False)
        assert rel_err(module(x), want) < 1e-5
        monkeypatch.undo()


@pytest.mark.parametrize("fmt, group", [("fp8", 0), ("int4", 64)])
def test_projections_of_one_input_in_one_gemv(monkeypatch, fmt, group):
    """FusedRows: three projections of one input (fp8: 64, 80 and 32 rows, padded to 128-row scale blocks) give what
    each gives alone, by one GEMV for 1-32 rows and by the parts for a prefill chunk and on a CPU without the
    interpreter; each part's weight and scales become views into the one weight, equal to what they were."""
    parts, before = [], []
    for i, rows in enumerate((64, 80, 32)):
        arrays = linear_ops.convert(random((rows, 256), 10 + i) * 0.05, fmt, group)
        weight = torch.from_numpy(arrays["weight"])
        weight = weight.view(torch.float8_e4m3fn) if fmt == "fp8" else weight
        scales = torch.from_numpy(arrays["scales"]).to(DEVICE)
        parts.append(linear_ops.QuantLinear(fmt, group, weight.to(DEVICE), scales, 256, torch.float32))
        before.append((parts[-1].weight.clone(), parts[-1].scales.clone()))
    fused = linear_ops.LinearOperator("linear.triton", None, "").fuse(parts)
    assert fused.starts == ([0, 128, 256] if fmt == "fp8" else [0, 64, 144])
    for m, (w, s) in zip(parts, before):
        assert torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(m.scales, s)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    launches = []
    for kernel in ("fp8_linear", "int4_linear"):
        real = getattr(linear_triton, kernel)
        monkeypatch.setattr(linear_triton, kernel,
                            lambda *a, real=real, **k: launches.append(a[1].shape) or real(*a, **k))
    for rows in (1, 3, 40):
        x = random((rows, 256), rows).to(DEVICE)
        launches.clear()
        outs = fused(x)
        assert [o.shape for o in outs] == [(rows, 64), (rows, 80), (rows, 32)]
        if rows <= linear_triton.DECODE_ROWS:
            assert launches == [fused.weight.shape]
        else:  # a prefill chunk: the parts' own paths
            assert fused.weight.shape not in launches
        for out, m in zip(outs, parts):
            assert out.is_contiguous() and rel_err(out.cpu(), m(x).cpu()) < 1e-5
    monkeypatch.setattr(linear_ops, "INTERPRET", False)
    x = random((1, 256), 9)
    if DEVICE == "cpu":
        launches.clear()
        assert all(rel_err(o, m(x)) < 1e-5 for o, m in zip(fused(x), parts)) and not launches
    other = "int4" if fmt == "fp8" else "fp8"  # projections of two formats: no fused form
    arrays = linear_ops.convert(random((32, 256), 3), other, 64 if other == "int4" else 0)
    weight = torch.from_numpy(arrays["weight"])
    weight = weight.view(torch.float8_e4m3fn) if other == "fp8" else weight
    mixed = [parts[0], linear_ops.QuantLinear(other, 64 if other == "int4" else 0, weight.to(DEVICE),
                                              torch.from_numpy(arrays["scales"]).to(DEVICE), 256, torch.float32)]
    assert linear_ops.LinearOperator("linear.triton", None, "").fuse(mixed) is None


def test_the_projections_of_one_input_run_as_one(tiny_dir):
    """Loaded with glm5 (fp8 projections, linear.triton): each attention's q_a_proj and kv_a_proj_with_mqa, with the
    indexer's wk on a full layer, and each MLP's gate_proj and up_proj (the dense layer's, the shared experts') are
    one call (loader.fuse_same_input); a prompt and a decode step give the logits of the same model calling them
    apart. The reference placement keeps them apart."""
    from glm5_offload.model.blocks import MLP

    model = load_model(tiny_dir(), device="cpu", rules=load_rules("glm5"), max_seq_len=64)
    attentions = [layer.self_attn for layer in model.model.layers]
    assert [len(a.fused_inputs.parts) for a in attentions] == [2 if a.indexer is None else 3 for a in attentions]
    assert {a.indexer is None for a in attentions} == {True, False}  # shared layers and full ones
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert len(mlps) == len(attentions) and all(len(m.fused_inputs.parts) == 2 for m in mlps)
    fusing = attentions + mlps

    def logits(fused):
        for m, f in zip(fusing, fused):
            m.fused_inputs = f
        cache = new_cache(model, 64)
        return torch.stack([model(torch.tensor(ids), cache)[-1] for ids in ([5, 17, 3, 99, 42], [8])])

    fused = [m.fused_inputs for m in fusing]
    assert rel_err(logits(fused), logits([None] * len(fused))) < 1e-5
    reference = load_model(tiny_dir(), device="cpu", rules=load_rules("glm5-reference"), max_seq_len=64)
    assert not any(getattr(m, "fused_inputs", None) for m in reference.modules())


def fast_linears(tmp_path, fmt: str, lm_head: bool = True) -> Path:
    """glm5-cpu with every projection (and lm_head) in `fmt` (linear.triton) and the embedding in host memory."""
    text = Path(load_rules("glm5-cpu").path).read_text()
    if lm_head:
        text = text.replace("    op: lm_head.reference\n    device: cpu",
                            f"    op: lm_head.triton\n    device: cpu\n    kwargs: {{format: {fmt}}}")
    text = text.replace("op: embedding.reference", "op: embedding.host")
    text += f"\n- match: {{class: Linear}}\n  replace: {{op: linear.triton, device: cpu, kwargs: {{format: {fmt}}}}}\n"
    path = tmp_path / f"linear-{fmt}.yaml"
    path.write_text(text)
    return path


def test_an_fp8_checkpoint_is_kept_as_released(tiny_dir, tmp_path, monkeypatch):
    """GLM-5-FP8's form: the e4m3 bytes and block scales of the checkpoint, never widened, nothing converted; the
    logits equal the reference operators' (which widen the same values at load) in fp32. (lm_head is bf16 in the
    releases, and stays with its reference here.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = torch.arange(12, 52)
    rules = load_rules(fast_linears(tmp_path, "fp8", lm_head=False))
    fast = load_model(tiny_dir(fp8=True), dtype=torch.float32, rules=rules)
    plain = load_model(tiny_dir(fp8=True), dtype=torch.float32, rules=load_rules("glm5-cpu"))
    o_proj = fast.model.layers[1].self_attn.o_proj
    assert isinstance(o_proj, linear_ops.QuantLinear) and o_proj.weight.dtype == torch.float8_e4m3fn
    assert fast.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32  # kept fp32
    assert not (tmp_path / "cache" / "glm5-offload" / "linear").exists()  # nothing converted
    assert rel_err(fast(ids, new_cache(fast, 64)), plain(ids, new_cache(plain, 64))) < 1e-5


@pytest.mark.parametrize("fmt, tolerance", [("fp8", 0.05), ("int4", 0.15)])
def test_a_bf16_checkpoint_is_quantised_once(tiny_dir, tmp_path, monkeypatch, fmt, tolerance):
    """A bf16 checkpoint's projections are quantised at load into the disk store, and read from it next time; each
    holds its bf16 weight to the format's precision."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = torch.arange(12, 52)
    rules = load_rules(fast_linears(tmp_path, fmt))
    first = load_model(tiny_dir(), dtype=torch.float32, rules=rules)
    stores = (tmp_path / "cache" / "glm5-offload" / "linear").glob("*/manifest.json")  # one per (format, group)
    entries = {name for store in stores for name in json.loads(store.read_text())["files"]}
    assert "model.layers.1.self_attn.o_proj.weight" in entries and "lm_head.weight" in entries
    again = load_model(tiny_dir(), dtype=torch.float32, rules=rules)
    logits = first(ids, new_cache(first, 64))
    assert torch.equal(logits, again(ids, new_cache(again, 64)))
    plain = load_model(tiny_dir(), dtype=torch.float32, rules=load_rules("glm5-cpu"))
    quantised = {n: m for n, m in first.named_modules() if isinstance(m, linear_ops.QuantLinear)}
    assert len(quantised) == len(entries)
    for name, module in quantised.items():
        assert rel_err(module.dense_weight(), plain.get_submodule(name).weight) < tolerance, name


def test_linear_kwargs_are_checked():
    op = linear_ops.OPERATORS[0]
    assert op.parse_kwargs({}) == {"format": "fp8", "group_size": None, "cache_dir": None}
    for kwargs, message in [({"format": "fp4"}, "format must be one of fp8, int4, bf16, got 'fp4'"),
                            ({"format": "int4", "group_size": 100}, "group_size must be one of 32, 64, 128"),
                            ({"format": "fp8", "group_size": 64}, "group_size is for format int4, not fp8"),
                            ({"cache_dir": 3}, "cache_dir must be a path")]:
        with pytest.raises(Glm5Error, match=message):
            op.parse_kwargs(kwargs)


def test_fitting_group():
    assert int_groups.fitting_group((6144, 2048), None) == 128
    assert int_groups.fitting_group((64, 32), None) == 32
    assert int_groups.fitting_group((6144, 2112), 64) == 64
    with pytest.raises(Glm5Error, match=r"no group size divides the inputs \(48\): use a format without groups"):
        int_groups.fitting_group((48,), None)
    assert np.lcm.reduce(int_groups.GROUP_SIZES) == 128


def test_prefill_widens_the_projections_but_not_lm_head():
    """A prefill chunk widens a projection's W for torch's GEMM (its bytes are workspace); lm_head, 1.9 GB widened
    for GLM-5, always runs the kernels."""
    from glm5_offload.config import load_config
    from glm5_offload.model import build_model
    from glm5_offload.ops.base import PlanContext
    from glm5_offload.rules import place

    config = load_config("glm-5")
    placement = place(build_model(config), load_rules("glm5"))
    ctx = PlanContext(config, torch.bfloat16, 4096, None, None, 2048, "cuda")
    o_proj, head = placement.slots["model.layers.0.self_attn.o_proj"], placement.slots["lm_head"]
    assert [b.bytes for b in o_proj.op.memory(o_proj, ctx) if b.kind == "workspace"] == [6144 * 16384 * 2]
    assert [b.bytes for b in head.op.memory(head, ctx) if b.kind == "workspace"] == [4 * 132 * 32 * 128 * 4]



def test_int4_weights_keep_a_trained_models_greedy_tokens(trained_checkpoint, tmp_path, monkeypatch):
    """Issue 17's accuracy bar: with every projection and lm_head in int4 (linear.triton, groups chosen to fit), the
    trained tiny model's greedy next token, teacher-forced over its four sequences' 64 tokens each, is its bf16
    self's >= 90% of the time (fp8: 100%; on make-tiny's random model 22% and 50%). The training's rounding, and so
    each sequence's figure, depends on the CPU and its threads: one sequence's 64 tokens agreed 95% on one 2-core
    machine and 89% on another (the four: 89, 95, 94, 91%, 92% in all). The decode kernels (one row a step) give
    prefill's logits in fp32."""
    from conftest import greedy_agreement

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, data = trained_checkpoint
    bf16 = load_model(path, dtype=torch.bfloat16, rules=load_rules("glm5-cpu"))
    int4 = load_model(path, dtype=torch.bfloat16, rules=load_rules(fast_linears(tmp_path, "int4")))
    assert int4.model.layers[1].self_attn.o_proj.fmt == "int4"
    agreed = []
    for sequence in data.tolist():
        prompt, tokens = sequence[:16], sequence[16:]
        assert greedy_agreement(bf16, prompt, tokens) == 1  # it learnt the sequence: its greedy continuation
        agreed.append(greedy_agreement(int4, prompt, tokens))
    assert sum(agreed) / len(agreed) >= 0.9, agreed
    # decode's kernels (one row a step) against prefill's, in fp32 (in bf16 a rounding step amplifies to ~1% of the
    # logits) and on the GPU where there is one (where the placement's CPU runs the kernels' reference)
    rules = tmp_path / "int4-here.yaml"
    rules.write_text(Path(fast_linears(tmp_path, "int4")).read_text().replace("device: cpu", f"device: {DEVICE}"))
    exact = load_model(path, dtype=torch.float32, rules=load_rules(rules))
    prompt, tokens = data[0, :16].tolist(), data[0, 16:].tolist()  # 80 tokens: prefill's path (> DECODE_ROWS)
    forced = exact(torch.tensor(prompt + tokens), new_cache(exact, 128))[len(prompt) - 1 : len(prompt) + 3]
    cache = new_cache(exact, 128)
    stepped = [exact(torch.tensor(prompt), cache)[-1]]
    for token in tokens[:3]:
        stepped.append(exact(torch.tensor([token]), cache)[-1])
    errors = [rel_err(a, b) for a, b in zip(stepped, forced)]
    assert max(errors) < 1e-4, errors
