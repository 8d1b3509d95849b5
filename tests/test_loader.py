"""Checkpoint loading: FP8 block dequantisation, the MTP layer, and one clear line for every bad input."""

import json
import logging
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_offload.errors import Glm5Error
from glm5_offload.formats import fp8_blocks
from glm5_offload.loader import load_model
from glm5_offload.runtime.kv_cache import new_cache
from glm5_offload.tiny import is_fp8_projection

FIRST_SHARD = "model-00001-of-00005.safetensors"


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A private copy of the bf16 tiny checkpoint, free to damage."""
    return shutil.copytree(tiny_dir(), tmp_path / "ckpt")


def weight_map(path):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def rewrite_shard(path, shard, change):
    tensors = load_file(path / shard)
    change(tensors)
    save_file(tensors, path / shard)


def rewrite_index(path, change):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    change(index["weight_map"])
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def load_error(path) -> str:
    with pytest.raises(Glm5Error) as e:
        load_model(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_fp8_checkpoint_loads_to_dequantised_weights_exactly(tiny_dir):
    path = tiny_dir("glm_moe_dsa", fp8=True)
    model = load_model(path, dtype=torch.float32)
    params = model.state_dict()
    shards = {}
    for file in set(weight_map(path).values()):
        shards.update(load_file(path / file))
    quantised = [n for n in shards if shards[n].dtype == torch.float8_e4m3fn]
    assert len(quantised) > 50 and all(is_fp8_projection(n) for n in quantised)
    for name in quantised:
        expected = fp8_blocks.dequantize(shards[name], shards[name + "_scale_inv"], (128, 128))
        assert torch.equal(params[name], expected), name
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    ids = torch.arange(12, 40)
    assert torch.isfinite(model(ids, new_cache(model, 32))).all()


def test_single_file_checkpoint_and_mtp_layer_skipped(ckpt, caplog):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    tensors = {}
    for file in set(weight_map(ckpt).values()):
        tensors.update(load_file(ckpt / file))
        (ckpt / file).unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    mtp = {n.replace("model.layers.4.", "model.layers.5.", 1): t.clone() for n, t in tensors.items() if n.startswith("model.layers.4.")}
    save_file({**tensors, **mtp}, ckpt / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="glm5_offload"):
        model = load_model(ckpt)
    lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(lines) == 1 and f"{len(mtp)} tensors" in lines[0] and "model.layers.5.*" in lines[0]
    assert torch.equal(model.state_dict()["model.norm.weight"], tensors["model.norm.weight"])


def test_tied_embeddings_read_the_embedding(ckpt):
    """tie_word_embeddings: lm_head reads model.embed_tokens.weight; a tied checkpoint that stores lm_head too is
    refused (its weight would be ignored)."""
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "unexpected tensor lm_head.weight" in load_error(ckpt)
    rewrite_shard(ckpt, weight_map(ckpt)["lm_head.weight"], lambda t: t.pop("lm_head.weight"))
    rewrite_index(ckpt, lambda m: m.pop("lm_head.weight"))
    model = load_model(ckpt)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.isfinite(model(torch.arange(12, 30), new_cache(model, 32))).all()


@pytest.mark.parametrize("mtp", [0, 1])
def test_layers_beyond_the_config_are_an_error_not_a_smaller_model(ckpt, mtp):
    """num_hidden_layers 3 on a 5-layer checkpoint: layer 3 is the MTP layer only where num_nextn_predict_layers says
    so; layer 4 (or 3 without MTP) is refused, naming the tensor."""
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "num_nextn_predict_layers": mtp}))
    message = load_error(ckpt)
    assert f"tensor model.layers.{3 + mtp}." in message and f"beyond the 3 decoder layers and {mtp} MTP" in message


def test_the_gpu_out_of_memory_while_loading_is_one_line(ckpt, monkeypatch):
    """The planner counts what the placement needs, not what other processes hold of the GPU: torch's
    OutOfMemoryError while a module's weights go there is one line naming the module, what torch tried and what to
    change."""
    from glm5_offload.ops.base import Operator

    real = Operator.build

    def out_of_memory(op, slot, checkpoint, ctx):
        if slot.name == "model.layers.2.self_attn":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
                                         "of 23.65 GiB of which 0.88 GiB is free. Including non-PyTorch memory ...")
        return real(op, slot, checkpoint, ctx)

    monkeypatch.setattr(Operator, "build", out_of_memory)
    assert load_error(ckpt) == (
        f"{ckpt}: the GPU ran out of memory loading model.layers.2.self_attn (CUDA out of memory. Tried to allocate "
        "1.50 GiB. GPU 0 has a total capacity of 23.65 GiB of which 0.88 GiB is free); rules that place less on the "
        "GPU, or --gpu-mem at what is free, fit (glm5 plan shows the budget)")


def test_missing_tensor(ckpt):
    name = next(n for n, f in weight_map(ckpt).items() if f == FIRST_SHARD)
    rewrite_shard(ckpt, FIRST_SHARD, lambda t: t.pop(name))
    rewrite_index(ckpt, lambda m: m.pop(name))
    assert f"missing tensor {name}" in load_error(ckpt)


def test_index_lists_tensor_the_shard_lacks(ckpt):
    name = next(n for n, f in weight_map(ckpt).items() if f == FIRST_SHARD)
    rewrite_shard(ckpt, FIRST_SHARD, lambda t: t.pop(name))
    message = load_error(ckpt)
    assert name in message and FIRST_SHARD in message


def test_unexpected_tensor(ckpt):
    name = "model.layers.1.self_attn.rotary_emb.inv_freq"
    rewrite_shard(ckpt, FIRST_SHARD, lambda t: t.update({name: torch.ones(8)}))
    rewrite_index(ckpt, lambda m: m.update({name: FIRST_SHARD}))
    assert f"unexpected tensor {name}" in load_error(ckpt)


def test_indexer_weights_on_a_shared_layer_are_unexpected(ckpt):
    name = "model.layers.2.self_attn.indexer.wk.weight"  # layer 2 is shared in the tiny pattern F F S F S
    rewrite_shard(ckpt, FIRST_SHARD, lambda t: t.update({name: torch.ones(32, 128)}))
    rewrite_index(ckpt, lambda m: m.update({name: FIRST_SHARD}))
    assert f"unexpected tensor {name}" in load_error(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    shard = weight_map(ckpt)[name]
    rewrite_shard(ckpt, shard, lambda t: t.update({name: t[name][:-1]}))
    message = load_error(ckpt)
    assert name in message and "(63, 128)" in message and "expected (64, 128)" in message


def test_wrong_dtype(ckpt):
    name = "model.norm.weight"
    shard = weight_map(ckpt)[name]
    rewrite_shard(ckpt, shard, lambda t: t.update({name: t[name].to(torch.int32)}))
    message = load_error(ckpt)
    assert name in message and "torch.int32" in message


def test_fp8_weight_without_scale(tiny_dir, tmp_path):
    path = shutil.copytree(tiny_dir("glm_moe_dsa", fp8=True), tmp_path / "fp8")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    shard = weight_map(path)[name]
    rewrite_shard(path, shard, lambda t: t.pop(name))
    rewrite_index(path, lambda m: m.pop(name))
    assert "model.layers.0.self_attn.o_proj.weight is float8_e4m3fn without its weight_scale_inv" in load_error(path)


def test_truncated_shard(ckpt):
    data = (ckpt / FIRST_SHARD).read_bytes()
    (ckpt / FIRST_SHARD).write_bytes(data[: len(data) - 1000])
    message = load_error(ckpt)
    assert FIRST_SHARD in message and "truncated" in message


def test_corrupt_shard_header(ckpt):
    data = bytearray((ckpt / FIRST_SHARD).read_bytes())
    data[8:40] = b"#" * 32
    (ckpt / FIRST_SHARD).write_bytes(bytes(data))
    message = load_error(ckpt)
    assert FIRST_SHARD in message and "corrupt" in message


def rewrite_header(path, edit):
    """The shard at path with edit(header) applied to its header (the data as it was)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def test_a_tensor_whose_bytes_disagree_with_its_header_is_named(ckpt):
    """A header whose dtype, shape or data offsets do not fit its tensor's bytes: one line naming the shard and the
    tensor, before any module reads it (safetensors' own message names neither, and came under another module's
    rule)."""
    shard = ckpt / FIRST_SHARD
    original = shard.read_bytes()
    (n,) = struct.unpack("<Q", original[:8])
    name, info = next((k, v) for k, v in json.loads(original[8 : 8 + n]).items()
                      if k != "__metadata__" and v["dtype"] in ("F32", "BF16") and v["data_offsets"][0] > 0)
    halved = {"F32": "BF16", "BF16": "U8"}[info["dtype"]]  # the same shape, half the bytes the offsets hold
    cases = [(lambda h: h[name].update(dtype=halved), f"{halved} {info['shape']} is"),
             (lambda h: h[name].update(data_offsets=[0, info["data_offsets"][1]]), f"{name}'s data starts at 0"),
             (lambda h: h[name].update(shape=[-1] + info["shape"][1:]), f"tensor {name}: shape [-1"),
             (lambda h: h[name].update(data_offsets=[str(o) for o in info["data_offsets"]]),
              "corrupt safetensors header"),
             (lambda h: [v.update(data_offsets=[o + 8 for o in v["data_offsets"]]) for k, v in h.items()
                         if k != "__metadata__"], "data starts at 8, the first must start at 0")]
    for edit, words in cases:
        shard.write_bytes(original)
        rewrite_header(shard, edit)
        message = load_error(ckpt)
        assert FIRST_SHARD in message and words in message, (words, message)
        assert "rule" not in message


def test_a_shard_header_nested_past_pythons_stack(ckpt):
    """A header of 100000 nested objects (its own size, consistent): one line, not a RecursionError."""
    nested = ('{"a":' * 100000 + "1" + "}" * 100000).encode()
    (ckpt / FIRST_SHARD).write_bytes(struct.pack("<Q", len(nested)) + nested)
    assert load_error(ckpt).endswith(f"{FIRST_SHARD}: corrupt safetensors header")
    (ckpt / "model.safetensors.index.json").write_text("[" * 100000 + "]" * 100000)
    assert "not a safetensors index" in load_error(ckpt)


@pytest.mark.parametrize("text", ["{nope", "[" * 100000 + "]" * 100000], ids=["not_json", "nested"])
def test_a_store_manifest_that_does_not_parse_is_an_empty_one(tmp_path, text):
    """A converted-weights store whose manifest.json is not JSON, or nested past Python's stack: no entry (they
    are made again), not an error."""
    from glm5_offload.disk_store import DiskStore

    store = DiskStore(tmp_path / "stores", tmp_path, {"format": "int4"}, 1)
    store.folder.mkdir(parents=True)
    (store.folder / "manifest.json").write_text(text)
    assert store.manifest() == {}


def test_missing_shard_file(ckpt):
    (ckpt / FIRST_SHARD).unlink()
    message = load_error(ckpt)
    assert FIRST_SHARD in message and "missing" in message


def test_a_context_beyond_the_models_positions_is_refused_before_any_shard_is_read(ckpt):
    (ckpt / FIRST_SHARD).unlink()  # a read would fail on it
    with pytest.raises(Glm5Error) as e:
        load_model(ckpt, max_seq_len=5000)
    assert str(e.value) == f"max_seq_len 5000 exceeds the model's max_position_embeddings 4096 ({ckpt / 'config.json'})"


def test_pickle_checkpoints_are_never_loaded(tmp_path, tiny_dir):
    shutil.copy(tiny_dir() / "config.json", tmp_path / "config.json")
    torch.save({"x": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    message = load_error(tmp_path)
    assert "pytorch_model.bin" in message and "never loaded" in message


@pytest.mark.parametrize("file", [7, None, "../elsewhere.safetensors", ""])
def test_index_naming_something_not_a_shard(ckpt, file):
    rewrite_index(ckpt, lambda m: m.update({"model.norm.weight": file}))
    assert f"weight_map gives model.norm.weight the file {file!r}, not a shard's file name" in load_error(ckpt)


def test_a_memory_map_refuses_dtypes_the_stores_never_write(tmp_path):
    from glm5_offload.checkpoint import memory_map, read_into_memory

    save_file({"x": torch.zeros(4, dtype=torch.float16)}, tmp_path / "f16.safetensors")
    for read in (memory_map, read_into_memory):
        with pytest.raises(Glm5Error, match="tensor x has dtype F16, not one of I8, U8, U16, I32, F32"):
            read(tmp_path / "f16.safetensors")


def test_huge_pages_counts_the_mappings_holding_the_arrays(tmp_path):
    """checkpoint.huge_pages: the mappings of arrays read into memory of their own (each at least its bytes, at
    most what the process maps), those in huge pages among them; a heap array's mapping counts too; none: 0."""
    from glm5_offload import checkpoint

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps here")
    save_file({"a": torch.randint(0, 255, (6 << 20,), dtype=torch.uint8)}, tmp_path / "t.safetensors")
    a = checkpoint.read_into_memory(tmp_path / "t.safetensors")["a"]
    mapped, huge = checkpoint.huge_pages([a])
    assert 6 << 20 <= mapped < 1 << 40 and 0 <= huge <= mapped and huge % (2 << 20) == 0  # whole 2 MiB pages
    assert checkpoint.huge_pages([]) == (0, 0)
    assert checkpoint.huge_pages([np.ones(1 << 20)])[0] >= 8 << 20


def test_a_store_read_into_memory_holds_the_files_values(tmp_path, monkeypatch):
    """Every tensor as the memory map reads it (several read chunks, an empty tensor), read-only; a file truncated
    after its header was checked (cut while being read) is refused in one line."""
    from glm5_offload import checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randint(0, 255, (3, 1000), generator=g, dtype=torch.uint8),
               "b": torch.randn(7, 33, generator=g), "empty": torch.zeros(0, 4, dtype=torch.int32)}
    save_file(tensors, tmp_path / "t.safetensors")
    monkeypatch.setattr(checkpoint, "READ_CHUNK", 512)
    path = tmp_path / "t.safetensors"
    got, mapped = checkpoint.read_into_memory(path), checkpoint.memory_map(path)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].shape == t.shape and np.array_equal(got[name], mapped[name]) and not got[name].flags.writeable
    assert np.array_equal(got["b"], tensors["b"].numpy())
    with open(tmp_path / "t.safetensors", "r+b") as f:  # what check_shard saw, then the file cut under the read
        real_check = checkpoint.check_shard
        monkeypatch.setattr(checkpoint, "check_shard", lambda p: (real_check(p), f.truncate(f.seek(0, 2) - 100))[0])
        with pytest.raises(Glm5Error, match=r"t.safetensors: tensor \w+ ends early"):
            checkpoint.read_into_memory(tmp_path / "t.safetensors")


def test_bad_index_file(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[]")
    assert "not a safetensors index" in load_error(ckpt)
