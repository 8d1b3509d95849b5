"""The GPU dequantisation of expert weights against int_groups.dequantize (interpreter on the CPU)."""

import pytest
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels import experts_triton

from conftest import assert_bf16_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt, group", [("int8", 32), ("int8", 128), ("int4", 32), ("int4", 128)])
def test_dequantize_equals_the_reference(fmt, group):
    w = torch.randn(1, 77, 256, generator=torch.Generator().manual_seed(group)) * 3  # 77 rows: a partial block
    values, scales = int_groups.quantize(w, fmt, group)
    want = int_groups.dequantize(values, scales, fmt, group)[0]
    out = torch.full((77, 256), float("nan"), device=DEVICE)  # poisoned: every element must be written
    experts_triton.dequantize(torch.from_numpy(values[0]).to(DEVICE), torch.from_numpy(scales[0]).to(DEVICE), fmt,
                              group, out=out)
    assert torch.equal(out.cpu(), want)  # q x scale in fp32: exact
    assert_bf16_of(experts_triton.dequantize(torch.from_numpy(values[0]).to(DEVICE),
                                             torch.from_numpy(scales[0]).to(DEVICE), fmt, group), want)
    with pytest.raises(ValueError, match="int8 or int4"):
        experts_triton.dequantize(torch.from_numpy(values[0]), torch.from_numpy(scales[0]), "bf16", group)
