"""config.json as published: the four shipped presets, derived layer types, and one-line errors."""

import json
from importlib import resources

import pytest

from glm5_offload.config import load_config, parse_config
from glm5_offload.errors import Glm5Error

PRESETS = resources.files("glm5_offload") / "presets"


def preset(name):
    return load_config(PRESETS / name)


def test_glm5_layer_counts():
    c = preset("glm-5.json")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (78, 6144, 64)
    assert len(c.full_layers) == 78  # index_topk_freq defaults to 1: every layer full
    assert c.mlp_layer_types[:3] == ("dense",) * 3 and len(c.moe_layers) == 75
    assert c.latent_dim == 576 and c.qk_head_dim == 256
    assert c.softmax_scale == pytest.approx(256**-0.5)
    assert c.rope_interleave and c.indexer_rope_interleave
    assert c.eos_token_ids == (154820, 154827, 154829)
    assert c.fp8_block_size is None and c.dtype == "bfloat16"


def test_glm5_fp8_quantization_config():
    c = preset("glm-5-fp8.json")
    assert c.fp8_block_size == (128, 128) and c.num_hidden_layers == 78


def test_glm52_indexshare_gives_21_full_layers():
    c = preset("glm-5.2.json")
    assert len(c.full_layers) == 21 and c.num_hidden_layers == 78
    assert c.indexer_types[:4] == ("full", "full", "full", "shared")
    assert c.full_layers[3:6] == [6, 10, 14]
    assert c.max_position_embeddings == 1048576 and c.rope.theta == 8e6


def test_deepseek_v32():
    c = preset("deepseek-v3.2.json")
    assert (c.num_hidden_layers, len(c.full_layers), len(c.moe_layers)) == (61, 61, 58)
    assert (c.n_group, c.topk_group) == (8, 4)
    assert not c.indexer_rope_interleave and c.rope_interleave
    assert c.rope.type == "yarn" and c.rope.factor == 40
    mscale = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert c.fp8_block_size == (128, 128)


def raw(**changes):
    data = json.loads((PRESETS / "glm-5.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def error_of(data, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Glm5Error) as e:
        load_config(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_unknown_model_type(tmp_path):
    assert "'model_type'" in error_of(raw(model_type="llama"), tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "kv_lora_rank", "index_topk", "model_type"])
def test_missing_field(tmp_path, field):
    message = error_of(raw(**{field: None}), tmp_path)
    assert f"'{field}' is missing" in message


@pytest.mark.parametrize("field, value", [("hidden_size", "6144"), ("num_hidden_layers", 78.5),
                                          ("rope_interleave", 1), ("index_topk", True), ("n_group", 0),
                                          ("index_topk_freq", "4"), ("index_topk_pattern", "FSX"),
                                          ("indexer_types", ["full"]), ("eos_token_id", "x")])
def test_ill_typed_field(tmp_path, field, value):
    assert f"'{field}'" in error_of(raw(**{field: value}), tmp_path)


@pytest.mark.parametrize("field, value, why", [
    ("rms_norm_eps", -1, "must be > 0, got -1.0"),
    ("rms_norm_eps", float("nan"), "must be a finite number, got float nan"),
    ("routed_scaling_factor", float("inf"), "must be a finite number, got float inf"),
    ("first_k_dense_replace", -2, "must be >= 0, got -2"),
    ("n_shared_experts", -1, "must be >= 0, got -1"), ("num_nextn_predict_layers", -1, "must be >= 0, got -1"),
    # counts of modules the tree is built with: a billion layers or experts took minutes and all memory to build
    ("num_hidden_layers", 10**9, "1000000000 is more than 1024, the most this engine builds"),
    ("n_routed_experts", 10**9, "1000000000 is more than 4096, the most this engine builds"),
    # an end id past the vocabulary never ends a reply: the model would talk on to max tokens, silently
    ("eos_token_id", [154820, 154880], "holds 154880, not a token id of the vocabulary (0..154879)"),
    ("eos_token_id", -1, "holds -1, not a token id of the vocabulary (0..154879)")])
def test_out_of_range_field(tmp_path, field, value, why):
    assert f"'{field}' {why}" in error_of(raw(**{field: value}), tmp_path)


def test_bad_rope_and_quantization(tmp_path):
    assert "'rope_type'" in error_of(raw(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), tmp_path)
    assert "'factor'" in error_of(raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), tmp_path)
    # a base or a factor <= 0 would put NaN in every rotation, silently
    assert "'rope_theta' must be > 0, got -5.0" in error_of(raw(rope_parameters={"rope_theta": -5}), tmp_path)
    yarn = {"rope_type": "yarn", "rope_theta": 1.0, "factor": 0, "original_max_position_embeddings": 4096}
    assert "'factor' must be > 0, got 0.0" in error_of(raw(rope_parameters=yarn), tmp_path)
    old_layout = raw(rope_parameters=None)
    old_layout.update(rope_theta=0)
    assert "'rope_theta' must be > 0, got 0.0" in error_of(old_layout, tmp_path)
    bad_q = {"quant_method": "fp8", "weight_block_size": [128]}
    assert "'weight_block_size'" in error_of(raw(quantization_config=bad_q), tmp_path)
    assert "'quant_method'" in error_of(raw(quantization_config={"quant_method": "awq"}), tmp_path)


def test_not_json_and_not_found(tmp_path):
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(Glm5Error, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)  # nested past Python's stack
    with pytest.raises(Glm5Error, match="config.json: not valid JSON .maximum recursion depth"):
        load_config(tmp_path)
    with pytest.raises(Glm5Error, match="no such config file"):
        load_config(tmp_path / "missing")


def test_indexer_pattern_sources():
    base = raw(num_hidden_layers=5, first_k_dense_replace=1)
    assert parse_config({**base, "index_topk_pattern": "FSSSF"}).indexer_types == ("full", "shared", "shared", "shared", "full")
    assert parse_config({**base, "indexer_types": ["full"] * 5}).full_layers == [0, 1, 2, 3, 4]
    assert parse_config({**base, "index_topk_freq": 2, "index_skip_topk_offset": 2}).full_layers == [0, 1, 3]
    assert parse_config({**base, "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"]}).moe_layers == [2, 3, 4]
    with pytest.raises(Glm5Error, match="must start with a 'full' layer"):
        parse_config({**base, "index_topk_pattern": "SFFFF"})


def test_old_rope_layout():
    data = raw(rope_parameters=None)
    data.update(rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                                "mscale": 1.0, "mscale_all_dim": 1.0})
    c = parse_config(data)
    assert c.rope.type == "yarn" and c.rope.theta == 10000 and c.rope.factor == 40


def test_generation_config_adds_its_end_of_turn_ids(tmp_path):
    """A release may keep its eos ids in generation_config.json only (transformers' generate stops at them)."""
    raw = json.loads(open(load_config("glm-5.3-flash").path).read())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [154820, 154827, 154829]}))
    assert load_config(tmp_path).eos_token_ids == (154820, 154827, 154829)
    raw["eos_token_id"] = 154827
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).eos_token_ids == (154827, 154820, 154829)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [154820, 200000]}')
    with pytest.raises(Glm5Error, match="generation_config.json: field 'eos_token_id' holds 200000, not a token id"):
        load_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "end"}')
    with pytest.raises(Glm5Error, match="generation_config.json: field 'eos_token_id' must be an integer or a list"):
        load_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1,')
    with pytest.raises(Glm5Error, match="generation_config.json: not valid JSON"):
        load_config(tmp_path)
