"""Each stored format's codec against its meaning, and its byte count against what the codec writes."""

import numpy as np
import pytest
import torch

from glm5_offload.config import load_config
from glm5_offload.formats import FP8_MAX, fp8_blocks, int_groups
from glm5_offload.formats.kv_rows import (
    dequantize_keys,
    dequantize_latent,
    fp8_row_width,
    key_bytes,
    latent_row_bytes,
    quantize_keys,
    quantize_latent,
)

from conftest import rel_err


def test_fp8_blocks_round_trip_with_partial_blocks():
    w = torch.randn(300, 200)  # partial 128-blocks on both axes
    w8, scale = fp8_blocks.quantize(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (3, 2) == fp8_blocks.scale_shape((300, 200))
    back = fp8_blocks.dequantize(w8, scale, (128, 128))
    assert rel_err(back, w) < 0.05  # e4m3 keeps 3 mantissa bits
    assert torch.equal(back[128:256, 128:200], w8[128:256, 128:200].float() * scale[1, 1])
    assert w8[:128, :128].float().abs().max() == FP8_MAX == 448  # each block's amax maps to e4m3's largest
    assert fp8_blocks.nbytes((300, 200)) == w8.numel() * w8.element_size() + scale.numel() * scale.element_size()


@pytest.mark.parametrize("fmt, group, bound", [("bf16", 128, 0.005), ("int8", 32, 0.01), ("int8", 128, 0.01),
                                               ("int4", 32, 0.12), ("int4", 128, 0.14)])
def test_int_groups_error_and_bytes(fmt, group, bound):
    w = torch.randn(3, 96, 256, generator=torch.Generator().manual_seed(group)) * 256**-0.5
    values, scales = int_groups.quantize(w, fmt, group)
    assert rel_err(int_groups.dequantize(values, scales, fmt, group), w) < bound
    if fmt != "bf16":
        assert scales.shape == (3, 96, 256 // group) and scales.dtype == np.float32
    assert values.nbytes == int_groups.BITS[fmt] * w.numel() // 8
    assert int_groups.nbytes(w.numel(), fmt, group) == values.nbytes + scales.nbytes
    assert int_groups.describe(fmt, group) == (fmt if fmt == "bf16" else f"{fmt}/g{group}")


def test_int4_packing_layout():
    w = torch.zeros(1, 1, 64)
    w[0, 0, :32] = 7.0  # group 64: inputs 0..31 in the low nibbles, 32..63 in the high ones
    w[0, 0, 32:] = -7.0
    v, s = int_groups.quantize(w, "int4", 64)
    assert v.shape == (1, 1, 32) and (v == (15 | (1 << 4))).all() and s[0, 0, 0] == pytest.approx(1.0)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="group size 96"):
        int_groups.quantize(torch.randn(1, 4, 256), "int8", 96)


def test_int8_activations_are_multiples_of_their_group_scale():
    v = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    q = int_groups.quantize_activations(v, 32).view(3, 2, 32)
    step = v.view(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(q / step, (q / step).round(), atol=1e-3) and (q - v.view(3, 2, 32)).abs().le(step / 2 + 1e-6).all()


def test_fp8_latent_row_is_656_bytes_and_close():
    config = load_config("glm-5")
    assert fp8_row_width(512, 64) == latent_row_bytes(config, "fp8") == 656
    assert latent_row_bytes(config, "bf16") == 1152 and latent_row_bytes(config, "fp32") == 2304
    rows = torch.randn(40, 576) * torch.rand(40, 1) * 10
    packed = quantize_latent(rows, 512)
    assert packed.dtype == torch.uint8 and packed.shape == (40, 656)
    back = dequantize_latent(packed, 512)
    assert torch.equal(back[:, 512:], rows[:, 512:].bfloat16().float())  # k_pe stays bf16
    assert rel_err(back[:, :512], rows[:, :512]) < 0.05


def test_fp8_key_form_is_132_bytes_and_close():
    config = load_config("glm-5")
    k = torch.randn(50, 128)
    k8, scales = quantize_keys(k)
    assert k8.element_size() * k8.shape[1] + scales.element_size() == key_bytes(config, "fp8") == 132
    assert key_bytes(config, "bf16") == 256
    assert rel_err(dequantize_keys(k8, scales), k) < 0.05
