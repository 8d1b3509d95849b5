"""GLM-5.3-Flash (glm5_next): its config, KDA, the pooled indexer, and token-exact parity with transformers'
Glm5NextForConditionalGeneration on checkpoints transformers saved (fp32, CPU)."""

import json
import re

import pytest
import torch

from glm5_offload.config import load_config, parse_config
from glm5_offload.errors import Glm5Error
from glm5_offload.loader import load_model
from glm5_offload.model.kda import KDA, forget_decay, kda_chunked, kda_recurrent, l2_normalise
from glm5_offload.model.pooled_indexer import PooledIndexer, PooledKeys, pool
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.kv_cache import new_cache

from conftest import greedy_steps, rel_err

PROMPT_LEN = 28  # > index_topk (8): whole groups are selected sparsely
CASES = [(4, 2), (4, 4), (8, 2), (8, 4)]  # (layers, index_kpool)


def prompt(seed=1, n=PROMPT_LEN):
    return torch.randint(4, 320, (n,), generator=torch.Generator().manual_seed(seed))


def max_rel_err(ours, theirs):
    return max(rel_err(ours[i], theirs[i]) for i in range(theirs.shape[0]))


@torch.no_grad()
def hf_greedy(hf, ids, n: int) -> list[int]:
    """transformers' own greedy decode, token by token from its cache (no logits processors: generate's
    min_new_tokens would ban the eos ids, which this engine, told to ignore them, may pick)."""
    out = hf(ids[None], use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_preset_is_the_published_shape():
    c = load_config("glm-5.3-flash")
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.n_routed_experts) == ("glm5_next", 45, 4096, 288)
    assert c.attention_types.count("kda") == 34 and c.kda_layers[:4] == [0, 1, 2, 4]
    assert c.full_layers == [i for i in range(45) if i % 4 == 3]
    assert (c.index_kpool, c.index_select_tail, c.hc_mult, c.swiglu_limit) == (16, True, 4, 10.0)
    assert (c.latent_dim, c.qk_rope_head_dim, c.text_prefix) == (512, 0, "model.language_model.")
    assert c.mlp_layer_types[:4] == ("dense", "dense", "dense", "moe")


def test_text_only_config_reads_under_model_prefix():
    raw = json.loads(open(load_config("glm-5.3-flash").path).read())
    flat = parse_config(raw["text_config"], "text.json")
    assert flat.text_prefix == "model." and flat.attention_types == load_config("glm-5.3-flash").attention_types


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention"] * 44 + ["mamba"]}, "layer_types"),
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
    ({"index_topk": 2050}, "index_topk"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"hc_mult": 0}, "hc_mult"),
    ({"index_kpool": 0}, "index_kpool"),
    ({"indexer_types": ["full"] * 3 + ["shared"] + ["full"] * 41}, "layer 3 is 'shared'"),
])
def test_bad_fields_are_named(change, message):
    raw = json.loads(open(load_config("glm-5.3-flash").path).read())
    raw["text_config"].update(change)
    with pytest.raises(Glm5Error, match=message) as e:
        parse_config(raw, "flash.json")
    assert "flash.json: text_config" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_kda_equals_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    H, Dk, Dv = 3, 16, 8
    q = l2_normalise(torch.randn(length, H, Dk, generator=g)) * Dk**-0.5
    k = l2_normalise(torch.randn(length, H, Dk, generator=g))
    v = torch.randn(length, H, Dv, generator=g)
    gate = -5 * torch.rand(length, H, Dk, generator=g)  # log decay in (-5, 0), as the lower bound makes it
    beta = torch.rand(length, H, generator=g)
    state = torch.randn(H, Dk, Dv, generator=g)
    o_ref, s_ref = kda_recurrent(q, k, v, gate, beta, state)
    o, s = kda_chunked(q, k, v, gate, beta, state, chunk=64)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("kpool", [2, 4])
def test_pooled_keys_written_token_by_token_equal_those_written_at_once(hf_next, kpool):
    path, _ = hf_next(4, kpool)
    model = load_model(path, dtype=torch.float32)
    indexer = model.model.layers[3].self_attn.indexer
    n, D = 23, indexer.head_dim
    g = torch.Generator().manual_seed(kpool)
    k, gates = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    at_once, by_token = (PooledKeys.empty(model.config, 64, "cpu", torch.float32) for _ in range(2))
    indexer.write_keys(k[:7], gates[:7], at_once, torch.arange(7))
    indexer.write_keys(k[7:], gates[7:], at_once, torch.arange(7, n))
    for p in range(n):
        indexer.write_keys(k[p : p + 1], gates[p : p + 1], by_token, torch.tensor([p]))
    complete = n // kpool
    want = pool(k[: complete * kpool].view(complete, kpool, D), gates[: complete * kpool].view(complete, kpool, D),
                indexer.index_kpool_compress_ape, torch.ones(complete, kpool, dtype=torch.bool))
    assert rel_err(at_once.groups[:complete], want) < 1e-6 and rel_err(by_token.groups[:complete], want) < 1e-6
    rest = n % kpool
    assert torch.equal(at_once.tail_keys[:rest], k[n - rest :]) and torch.equal(by_token.tail_keys[:rest], k[n - rest :])


def test_forget_decay_is_in_its_bounds():
    g = torch.Generator().manual_seed(3)
    logits, A_log, dt_bias = 10 * torch.randn(7, 2, 4, generator=g), torch.randn(2, generator=g), torch.randn(8, generator=g)
    bounded = forget_decay(logits, A_log, dt_bias, -5.0)
    assert (bounded >= -5).all() and (bounded <= 0).all() and bounded.std() > 0.5  # saturates at the ends
    assert (forget_decay(logits, A_log, dt_bias, None) <= 0).all()


def group_scores(q, group_keys, weights, positions, kpool: int):
    """score[s, g] = sum_h w[s,h] relu(q[s,h] . key_g) D^-0.5; -inf for groups not complete at positions[s]:
    transformers' pooled scores, written out."""
    logits = torch.einsum("shd,gd->shg", q.float(), group_keys.float()) * q.shape[-1] ** -0.5
    scores = torch.einsum("sh,shg->sg", weights, torch.relu(logits))
    complete = (torch.arange(group_keys.shape[0], device=q.device)[None, :] + 1) * kpool <= positions[:, None] + 1
    return scores.masked_fill(~complete, float("-inf"))


@pytest.mark.parametrize("indexer", ["reference", "dsa_triton"])
@pytest.mark.parametrize("kpool", [2, 16])
def test_pooled_scores_equal_the_written_out_form(kpool, indexer):
    """PooledIndexer.scores and pooled_indexer.dsa_triton's (the lightning indexer's scores and its Triton kernel,
    their causal mask at the query's last complete group) against the group scores written out."""
    from types import SimpleNamespace

    from glm5_offload.ops.dsa_triton import TritonPooledIndexer

    g = torch.Generator().manual_seed(kpool)
    S, H, D, end = 5, 16, 32, 150
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = PooledKeys(torch.randn(-(-200 // kpool), D, generator=g).to(device), None, None)
    q = torch.randn(S, H, D, generator=g).to(device)
    weights = torch.randn(S, H, generator=g).to(device)
    positions = torch.tensor([0, kpool - 2, kpool - 1, 77, end - 1]).clamp(min=0).to(device)
    scores = (PooledIndexer if indexer == "reference" else TritonPooledIndexer).scores
    got = scores(SimpleNamespace(kpool=kpool), q, cache, weights, positions, end)
    want = group_scores(q, cache.groups[: end // kpool], weights, positions, kpool)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert rel_err(got[finite], want[finite]) < 1e-5
    few = positions[:2]  # fewer tokens than a group: no group to score
    assert scores(SimpleNamespace(kpool=kpool), q[:2], cache, weights[:2], few, kpool - 1).shape == (2, 0)


@pytest.mark.parametrize("layers, kpool", CASES)
def test_prefill_logits_match_every_position(hf_next, layers, kpool):
    path, hf = hf_next(layers, kpool)
    ids = prompt()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    assert max_rel_err(model(ids, new_cache(model, 64)), theirs) < 1e-3


@pytest.mark.parametrize("layers, kpool", CASES)
def test_chunked_prefill_and_decode_match_the_full_forward(hf_next, layers, kpool):
    path, hf = hf_next(layers, kpool)
    ids = prompt(2)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    cache = new_cache(model, 64)
    steps = [model(ids[:7], cache), model(ids[7:13], cache)] + [model(ids[i : i + 1], cache)
                                                                 for i in range(13, PROMPT_LEN)]
    assert max_rel_err(torch.cat(steps), theirs) < 1e-3


@pytest.mark.parametrize("layers, kpool", CASES)
def test_greedy_tokens_identical(hf_next, layers, kpool):
    path, hf = hf_next(layers, kpool)
    ids = prompt(3)
    n_new = 24
    engine = Engine(load_model(path, dtype=torch.float32))
    engine.stop_ids = set()
    assert engine.generate(ids.tolist(), n_new).output_ids == hf_greedy(hf, ids, n_new)


def first_turn(hf_next):
    """(model, its engine after a first turn, that turn's prompt, its reply, 9 more prompt tokens)."""
    path, _ = hf_next(8, 4)
    model = load_model(path, dtype=torch.float32)
    first, extra = prompt(4).tolist(), prompt(5, 9).tolist()
    engine = Engine(model, cuda_graphs=False)
    engine.stop_ids = set()
    return model, engine, first, engine.generate(first, 6).output_ids, extra


def test_second_turn_resumes_and_decodes_what_a_fresh_engine_decodes(hf_next):
    """A KDA state cannot be rewound: the engine resumes at its end or at the point before the last prompt token."""
    model, engine, first, out, extra = first_turn(hf_next)
    cases = {"extends the whole cache": first + out + extra, "repeats the prompt": first,
             "extends the prompt only": first + extra, "shares nothing": extra + first}
    for what, ids in cases.items():
        fresh = Engine(model, cuda_graphs=False)
        fresh.stop_ids = set()
        want = fresh.generate(ids, 6).output_ids
        result = engine.generate(ids, 6)
        assert result.output_ids == want, what
        expected_reuse = {"extends the whole cache": len(first) + len(out) - 1,  # the last token was never fed
                          "repeats the prompt": len(first) - 1,
                          "extends the prompt only": len(first) - 1, "shares nothing": 0}[what]
        assert result.reused_tokens == expected_reuse, what
        engine.generate(first, 6)  # back to the first conversation for the next case


@pytest.mark.parametrize("cut_at", ["prefill", "decode"])
def test_a_pass_cut_short_leaves_no_trace_in_the_kda_states(hf_next, cut_at):
    """Ctrl-C (or the GPU out of memory) in the middle of a forward: the KDA layers before the cut have taken the
    pass into their states in place, the cache's length has not; the engine goes back to its resume point (or to
    empty), so the next turn decodes what a fresh engine decodes."""
    model, engine, first, out, extra = first_turn(hf_next)
    calls = []

    def cut(module, args):  # in the second KDA layer, the first one's state updated: the prefill of the new tokens,
        calls.append(args[0].shape[0])  # or the second decode step (the first feeds the prompt's last token)
        if (args[0].shape[0], calls.count(1)) == ((1, 2) if cut_at == "decode" else (len(extra), 0)):
            raise KeyboardInterrupt

    hook = [m for m in model.modules() if isinstance(m, KDA)][1].register_forward_pre_hook(cut)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(first + out + extra, 6)
    hook.remove()
    assert calls == ([len(extra), 1, 1] if cut_at == "decode" else [len(extra)])
    ids = first + out + extra + prompt(6, 3).tolist()
    fresh = Engine(model, cuda_graphs=False)
    fresh.stop_ids = set()
    assert engine.generate(ids, 6).output_ids == fresh.generate(ids, 6).output_ids


def test_make_tiny_checkpoint_loads_in_transformers_with_same_logits(tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    from glm5_offload.tiny import make_tiny

    path = make_tiny(tmp_path / "flash", arch="glm5_next")
    hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(12, 1024, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    assert max_rel_err(model(ids, new_cache(model, 64)), theirs) < 1e-3


def test_an_fp8_flash_checkpoint_is_kept_as_released(tmp_path, monkeypatch):
    """make-tiny --arch glm5_next --fp8: the FP8 projections (KDA's and MLA's) are kept as e4m3 blocks by the Flash
    rules (nothing converted), and the logits are those of the reference operators, which widen the same values."""
    from glm5_offload.ops.linear_triton import QuantLinear
    from glm5_offload.rules import load_rules, resolve_rules_path
    from glm5_offload.tiny import make_tiny

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = make_tiny(tmp_path / "flash8", arch="glm5_next", fp8=True)
    text, experts_kwargs = re.subn(r"    kwargs: \{format: int4, activations: int8, gpu_tokens: \d+, decode_gpu_experts: "
                                   r"auto\}\n", "", resolve_rules_path("glm5-flash").read_text())
    assert experts_kwargs == 1
    text = text.replace("op: experts.numba", "op: experts.reference")
    text = text.replace("kv_dtype: fp8, kv_offload: true, ", "").replace("attention.dsa_triton", "attention.reference")
    text = text.replace("pooled_indexer.dsa_triton", "pooled_indexer.reference").replace(
        "hyper_connection.triton", "hyper_connection.reference").replace(  # only the projections differ
        "kwargs: {format: fp8}\n\n- match:\n    class: Linear", "kwargs: {format: bf16}\n\n- match:\n    class: "
        "Linear")  # lm_head is bf16 in the release
    (tmp_path / "rules.yaml").write_text(text)
    fast = load_model(path, dtype=torch.float32, rules=load_rules(tmp_path / "rules.yaml"), device="cpu")
    plain = load_model(path, dtype=torch.float32)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.kv_b_proj"):
        module = fast.get_submodule(name)
        assert isinstance(module, QuantLinear) and module.weight.dtype == torch.float8_e4m3fn, name
    assert not (tmp_path / "cache" / "glm5-offload" / "linear").exists()
    ids = torch.arange(12, 52)
    assert rel_err(fast(ids, new_cache(fast, 64)), plain(ids, new_cache(plain, 64))) < 1e-4


def test_saved_context_resumes_the_kda_states(hf_next, tmp_path):
    """generate --save-context / --load-context: a second engine resumes the rows, pooled keys and KDA states and
    decodes what the first would have."""
    from glm5_offload.runtime.saved_context import load_context, save_context

    path, _ = hf_next(8, 4)
    model = load_model(path, dtype=torch.float32)
    first = prompt(6).tolist()
    engine = Engine(model, max_seq_len=128, cuda_graphs=False)
    engine.stop_ids = set()
    out = engine.generate(first, 5).output_ids
    assert save_context(engine, tmp_path / "ctx") == len(first) + 4
    follow = first + out + prompt(7, 5).tolist()
    want = engine.generate(follow, 6).output_ids
    resumed = Engine(model, max_seq_len=128, cuda_graphs=False)
    resumed.stop_ids = set()
    assert load_context(resumed, tmp_path / "ctx") == len(first) + 4
    result = resumed.generate(follow, 6)
    assert result.reused_tokens == len(first) + 4 and result.output_ids == want


@pytest.mark.parametrize("formats", ["shipped", "bf16"])
def test_the_tiny_flash_model_runs_under_its_default_rules_on_the_cpu(hf_next, tmp_path, formats):
    """--device cpu with rules/glm5-flash.yaml: kda.fla and the Triton operators run their references or Triton's
    interpreter. With every format widened to bf16 (weights, experts; rows in the model's dtype) the logits are
    transformers' within bf16 rounding; as shipped (FP8 projections and rows, int4 experts) within what those
    formats cost a tiny random model (GLM-5's tiny model under glm5.yaml: 25%), and it decodes on from them."""
    from glm5_offload.rules import load_rules, resolve_rules_path

    path, hf = hf_next(4, 2)
    ids = prompt(8)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    text = resolve_rules_path("glm5-flash").read_text()
    if formats == "bf16":
        text = text.replace("format: fp8", "format: bf16").replace("format: int4, activations: int8",
                                                                   "format: bf16").replace("kv_dtype: fp8, ", "")
    (tmp_path / "rules.yaml").write_text(text)
    placed = load_model(path, dtype=torch.float32, rules=load_rules(tmp_path / "rules.yaml"), device="cpu")
    ops = {s.op.name for s in placed.placement.slots.values()}
    assert {"kda.reference", "experts.numba", "linear.triton", "attention.dsa_triton",
            "hyper_connection.triton"} <= ops
    cache = new_cache(placed, 64)
    ours = placed(ids, cache)
    errors = sorted(rel_err(ours[i], theirs[i]) for i in range(PROMPT_LEN))
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    if formats == "bf16":
        assert errors[-1] < 1e-2 and agree == 1
    else:
        assert errors[PROMPT_LEN // 2] < 0.5 and agree >= 0.3
    greedy_steps(placed, cache, ours[-1])  # each step costs seconds here


def test_a_kda_layers_projections_of_its_input_run_as_one(hf_next):
    """Under rules/glm5-flash.yaml (FP8 projections, linear.triton) each KDA layer's six projections of x are one call
    (loader.fuse_same_input): a prompt and a decode step give the logits of the same model calling them apart."""
    from glm5_offload.rules import load_rules

    path, _ = hf_next(4, 2)
    model = load_model(path, dtype=torch.float32, rules=load_rules("glm5-flash"), device="cpu")
    kdas = [m for m in model.modules() if isinstance(m, KDA)]
    assert kdas and all(len(m.fused_inputs.parts) == len(KDA.SAME_INPUT) for m in kdas)

    def logits(fused):
        for m, f in zip(kdas, fused):
            m.fused_inputs = f
        cache = new_cache(model, 64)
        return torch.stack([model(torch.tensor(ids), cache)[-1] for ids in (prompt(6, 12).tolist(), [8])])

    fused = [m.fused_inputs for m in kdas]
    assert rel_err(logits(fused), logits([None] * len(fused))) < 1e-5


# ------------------------------------------------------------------ on the GPU (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 300])
@pytest.mark.parametrize("bound", [-5.0, None])  # the bounded gate, the softplus one
def test_fla_kda_equals_the_reference_on_the_gpu(length, bound):
    """kda.fla's recurrence (fla-core: fused_recurrent_kda for one token, chunk_kda for more) against the plain-torch
    one, at the real head dim."""
    from types import SimpleNamespace

    from glm5_offload.model import KDA
    from glm5_offload.ops.kda_fla import FlaKDA

    g = torch.Generator(device="cuda").manual_seed(length)
    H, D = 8, 128
    q, k, v, logits = (torch.randn(length, H, D, device="cuda", generator=g) for _ in range(4))
    beta = torch.rand(length, H, device="cuda", generator=g)
    state = torch.randn(H, D, D, device="cuda", generator=g) * 0.1
    A_log, dt_bias = torch.randn(H, device="cuda", generator=g) * 0.5, torch.randn(H * D, device="cuda", generator=g)
    layer = SimpleNamespace(A_log=A_log, dt_bias=dt_bias * 0.5, lower_bound=bound)
    layer.prepare = lambda *t: KDA.prepare(layer, *t)
    o, s = FlaKDA.recurrence(layer, q, k, v, logits, beta, state)
    o_ref, s_ref = KDA.recurrence(layer, q, k, v, logits, beta, state)
    assert rel_err(o, o_ref) < 2e-3 and rel_err(s, s_ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("layers, kpool", [(4, 2), (8, 4)])
def test_flash_rules_on_the_gpu_match_transformers(hf_next, tmp_path, layers, kpool):
    """rules/glm5-flash.yaml on the GPU with its formats widened to bf16: the CPU reference's logits (transformers'
    to 1e-3, tests above; transformers itself would call fla-core on its CPU tensors where fla-core is installed)
    within bf16 rounding, and its greedy tokens from CUDA graphs equal to eager decode's (a graph's warm-up must not
    advance the KDA states twice)."""
    from glm5_offload.rules import load_rules, resolve_rules_path

    path, _ = hf_next(layers, kpool)
    ids = prompt(9)
    reference = load_model(path, dtype=torch.float32)
    theirs = reference(ids, new_cache(reference, 64))
    text = resolve_rules_path("glm5-flash").read_text().replace("format: fp8", "format: bf16").replace(
        "format: int4, activations: int8", "format: bf16").replace("kv_dtype: fp8, ", "")
    (tmp_path / "rules.yaml").write_text(text)
    placed = load_model(path, dtype=torch.float32, rules=load_rules(tmp_path / "rules.yaml"))
    assert {s.op.name for s in placed.placement.slots.values()} >= {"kda.fla", "attention.dsa_triton"}
    ours = placed(ids.cuda(), new_cache(placed, 64)).cpu()
    errors = sorted(rel_err(ours[i], theirs[i]) for i in range(PROMPT_LEN))
    # fla-core's dots round to tf32/bf16: a near-tie in the group selection may flip at a position or two
    assert errors[PROMPT_LEN // 2] < 1e-2
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    outputs = {}
    for graphs in (True, False):
        engine = Engine(placed, cuda_graphs=graphs)
        engine.stop_ids = set()
        outputs[graphs] = engine.generate(ids.tolist(), 12).output_ids
        assert (engine.graphs is not None) == graphs
    assert outputs[True] == outputs[False]


def test_bad_flash_checkpoints_are_named_as_stored(tmp_path):
    """Errors name the release's tensor names (model.language_model.*, hc_attn_fn), not the model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from glm5_offload.tiny import make_tiny

    good = make_tiny(tmp_path / "good", arch="glm5_next")
    index = json.loads((good / "model.safetensors.index.json").read_text())
    for change, message in (("drop", "missing tensor model.language_model.layers.0.hc_attn_fn"),
                            ("extra", "unexpected tensor model.language_model.layers.0.bogus.weight")):
        bad = tmp_path / change
        shutil.copytree(good, bad)
        shard = bad / index["weight_map"]["model.language_model.layers.0.hc_attn_fn"]
        tensors = load_file(shard)
        if change == "drop":
            del tensors["model.language_model.layers.0.hc_attn_fn"]
            weight_map = {k: v for k, v in index["weight_map"].items() if k != "model.language_model.layers.0.hc_attn_fn"}
        else:
            tensors["model.language_model.layers.0.bogus.weight"] = torch.zeros(2)
            weight_map = {**index["weight_map"], "model.language_model.layers.0.bogus.weight": shard.name}
        save_file(tensors, shard)
        (bad / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(Glm5Error, match=message.replace(".", r"\.")) as e:
            load_model(bad, dtype=torch.float32)
        assert "\n" not in str(e.value)
