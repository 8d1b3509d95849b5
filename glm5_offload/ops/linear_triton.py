"""`linear.triton` and `lm_head.triton`: a projection whose weight stays in 8 or 4 bits on its device.

kwargs: format
  fp8   e4m3 with one fp32 scale per 128 x 128 block (formats/fp8_blocks.py). An FP8 checkpoint's weights are kept
        exactly as released (never widened); a bf16 one is quantised per block at load.
  int4  symmetric groups of `group_size` inputs (formats/int_groups.py, w4a16); group_size 32, 64 or 128, by default
        the largest that divides the inputs (one that does not is refused, naming those that would).
  bf16  the compute dtype (what linear.reference holds).
Converted weights are kept in a disk store beside the converted experts (`cache_dir`), so the next start reads them.
Decode (up to 32 tokens) runs kernels/linear_triton.py's GEMV, which reads the packed weights once. A prefill chunk
of an fp8 weight runs cuBLAS's FP8 GEMM with DeepSeek's block scales where torch and the GPU have it (F.scaled_mm;
sm90), its activations quantised per 128 inputs as DeepSeek's inference does; otherwise it widens W to the compute
dtype in one kernel and runs torch's GEMM (faster on the H200 than the FP8-dot Triton GEMM: bench/RESULTS.md).
The CPU tests run the kernels in Triton's interpreter; on a CPU without it the kernels' reference
(the same weights, dequantised) runs, so a placement can be tried on any machine. Tensors the model keeps in fp32
(the indexer's weights_proj) stay fp32, as linear.reference has them.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..disk_store import DiskStore
from ..errors import Glm5Error
from ..formats import dtype_name, fp8_blocks, int_groups
from ..kernels import INTERPRET, experts_triton, linear_triton
from ..model import Linear, LMHead, keeps_fp32
from ..util import cache_dir
from .base import Buffer, BuildContext, Operator, PlanContext, Slot

FORMATS = ("fp8", "int4", "bf16")
STORE_VERSION = 1


class QuantLinear(nn.Module):
    """y = x W^T with W in fp8 (weight e4m3 [N, K], scales [cdiv(N,128), cdiv(K,128)]) or int4 (weight uint8
    [N, K/2], scales [N, K/group])."""

    def __init__(self, fmt: str, group: int, weight: torch.Tensor, scales: torch.Tensor, in_features: int,
                 dtype: torch.dtype, widen: bool = True):
        """widen: a prefill chunk widens W for torch's GEMM (not lm_head: 1.9 GB widened, for one row's logits)."""
        super().__init__()
        self.fmt, self.group, self.in_features, self.out_features = fmt, group, in_features, weight.shape[0]
        self.compute_dtype, self.widen = dtype, widen
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def extra_repr(self) -> str:
        fmt = "fp8 (128x128 blocks)" if self.fmt == "fp8" else f"int4/g{self.group}"
        return f"in_features={self.in_features}, out_features={self.out_features}, format={fmt}"

    def _kernels(self) -> bool:
        return self.weight.is_cuda or INTERPRET

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        if not self._kernels():  # the kernels' reference, on a CPU without Triton's interpreter
            y = F.linear(flat.float(), self.dense_weight(torch.float32)).to(x.dtype)
        elif self.widen and flat.shape[0] > linear_triton.DECODE_ROWS and flat.is_cuda:  # prefill
            if self.blockwise_fp8(flat):  # cuBLAS's FP8 GEMM on the weights as stored
                y = linear_triton.fp8_blockwise_linear(flat, self.weight, self.scales)
            else:  # W widened, torch's GEMM
                y = F.linear(flat, self.dense_weight(flat.dtype))
        elif self.fmt == "fp8":
            y = linear_triton.fp8_linear(flat, self.weight, self.scales)
        else:
            y = linear_triton.int4_linear(flat, self.weight, self.scales, self.group)
        return y.view(*x.shape[:-1], self.out_features)

    def blockwise_fp8(self, x: torch.Tensor) -> bool:
        return (self.fmt == "fp8" and x.dtype == torch.bfloat16
                and linear_triton.blockwise_shape(self.out_features, self.in_features)
                and linear_triton.has_blockwise_fp8_mm(x.device))

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out, in] dequantised, in the compute dtype (absorbed MLA reads kv_b_proj's whole)."""
        dtype = dtype or self.compute_dtype
        if self.fmt == "fp8":
            if self._kernels():
                return linear_triton.fp8_dequantize(self.weight, self.scales, dtype)
            return fp8_blocks.dequantize(self.weight, self.scales).to(dtype)
        if self._kernels():
            return experts_triton.dequantize(self.weight, self.scales, "int4", self.group, dtype=dtype)
        return int_groups.dequantize(self.weight.numpy(), self.scales.numpy(), "int4", self.group).to(dtype)


class FusedRows:
    """QuantLinears of one format that read the same input, their rows in one weight (fp8: each one's rows padded to
    whole 128-row scale blocks), each one's weight and scales then views into it (no second copy). A decode step
    (up to DECODE_ROWS tokens) runs one GEMV over all the rows (a launch instead of several: bench/RESULTS.md);
    a prefill chunk, or a CPU without Triton's interpreter, calls the parts. A plain object, not a module: the
    parts stay the model's modules, their tensors counted once."""

    def __init__(self, parts: list[QuantLinear]):
        first = parts[0]
        pad = linear_triton.BLOCK if first.fmt == "fp8" else 1
        rows = [-(-m.out_features // pad) * pad for m in parts]
        self.parts, self.starts = parts, [sum(rows[:i]) for i in range(len(parts))]
        raw = first.weight.view(torch.uint8)  # (e4m3 as its bytes: zero fills and row copies of any GPU's torch)
        weight = raw.new_zeros((sum(rows),) + raw.shape[1:])
        self.scales = first.scales.new_zeros((sum(rows) // pad,) + first.scales.shape[1:])  # fp8: a row a block
        for m, start in zip(parts, self.starts):
            weight[start : start + m.out_features] = m.weight.view(torch.uint8)
            self.scales[start // pad : start // pad + m.scales.shape[0]] = m.scales
        self.weight = weight.view(first.weight.dtype)
        for m, start in zip(parts, self.starts):
            m.weight = self.weight[start : start + m.out_features]
            m.scales = self.scales[start // pad : start // pad + m.scales.shape[0]]

    def __call__(self, x) -> list[torch.Tensor]:
        first = self.parts[0]
        flat = x.reshape(-1, first.in_features)
        if flat.shape[0] > linear_triton.DECODE_ROWS or not first._kernels():
            return [m(x) for m in self.parts]
        if first.fmt == "fp8":
            y = linear_triton.fp8_linear(flat, self.weight, self.scales)
        else:
            y = linear_triton.int4_linear(flat, self.weight, self.scales, first.group)
        return [y[:, start : start + m.out_features].contiguous().view(*x.shape[:-1], m.out_features)
                for m, start in zip(self.parts, self.starts)]


class LinearOperator(Operator):
    """A projection (or lm_head) in fp8, int4 or bf16 on its device."""

    def parse_kwargs(self, kwargs: dict) -> dict:
        k = {"format": "fp8", "group_size": None, "cache_dir": None, **kwargs}
        if k["format"] not in FORMATS:
            raise Glm5Error(f"format must be one of {', '.join(FORMATS)}, got {k['format']!r}")
        if k["group_size"] is not None and k["group_size"] not in int_groups.GROUP_SIZES:
            raise Glm5Error(f"group_size must be one of {', '.join(map(str, int_groups.GROUP_SIZES))}, "
                            f"got {k['group_size']!r}")
        if k["group_size"] is not None and k["format"] != "int4":
            raise Glm5Error(f"group_size is for format int4, not {k['format']}")
        if k["cache_dir"] is not None and not isinstance(k["cache_dir"], str):
            raise Glm5Error(f"cache_dir must be a path, got {k['cache_dir']!r}")
        return k

    def check(self, slot: Slot):
        self._packing(slot)

    def _packing(self, slot: Slot) -> tuple[str, int]:
        """(format, int4 group) the slot holds: the reference's where the model keeps the weight in fp32."""
        if keeps_fp32(slot.tensor_name("weight")):
            return "fp32", 0
        fmt = slot.kwargs["format"]
        if fmt != "int4":
            return fmt, 0
        return fmt, int_groups.fitting_group((slot.module.in_features,), slot.kwargs["group_size"])

    def format(self, slot: Slot, dtype: torch.dtype) -> str:
        fmt, group = self._packing(slot)
        return {"fp8": "fp8/b128", "int4": f"int4/g{group}", "bf16": dtype_name(dtype)}.get(fmt, fmt)

    def weight_bytes(self, slot: Slot, dtype: torch.dtype) -> int:
        fmt, group = self._packing(slot)
        shape = (slot.module.out_features, slot.module.in_features)
        if fmt == "fp8":  # rows padded to whole 128-row scale blocks: as FusedRows holds them (kv_a's 576 -> 640)
            return fp8_blocks.nbytes((-(-shape[0] // linear_triton.BLOCK) * linear_triton.BLOCK, shape[1]))
        if fmt == "int4":
            return int_groups.nbytes(shape[0] * shape[1], "int4", group)
        return super().weight_bytes(slot, dtype)

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """The weights, and as workspace a decode step's partial sums (split over the inputs: at most 4 programs of
        [32, 128] fp32 per SM, on a GPU of up to 132 SMs) or a prefill's widened W, or its FP8 activations where
        cuBLAS's blockwise GEMM may take the shape (not lm_head's)."""
        fmt = self._packing(slot)[0]
        if fmt not in ("fp8", "int4"):
            return super().memory(slot, ctx)
        partials = 4 * 132 * linear_triton.DECODE_ROWS * 128 * 4
        N, K = slot.module.out_features, slot.module.in_features
        prefill = 0
        if self.replaces is not LMHead:
            prefill = N * K * ctx.dtype.itemsize
            if fmt == "fp8" and linear_triton.blockwise_shape(N, K):
                rows = ctx.prefill_chunk + 3  # padded to a multiple of 4 (fp8_blockwise_linear)
                prefill = max(prefill, rows * (K + K // linear_triton.BLOCK * 4))
        return [Buffer(slot.device, "weights", self.weight_bytes(slot, ctx.dtype)),
                Buffer(slot.device, "workspace", max(partials, prefill))]

    def fuse(self, modules: list[nn.Module]) -> FusedRows | None:
        """Fp8 or int4 projections of one input, format, group size, device and dtype: one GEMV a decode step."""
        keys = {(type(m), getattr(m, "fmt", None), getattr(m, "group", None), getattr(m, "in_features", None),
                 m.weight.device, getattr(m, "compute_dtype", None)) for m in modules}
        if len(keys) != 1 or not isinstance(modules[0], QuantLinear):
            return None
        return FusedRows(modules)

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> nn.Module:
        fmt, group = self._packing(slot)
        if fmt not in ("fp8", "int4"):
            return super().build(slot, checkpoint, ctx)
        name = slot.tensor_name("weight")
        stored = checkpoint.read_fp8(name) if fmt == "fp8" else None
        if stored is None:  # converted once, kept on disk
            store = DiskStore(Path(slot.kwargs["cache_dir"] or cache_dir() / "linear"), ctx.model_dir,
                              {"format": fmt, "group_size": group}, STORE_VERSION)
            arrays = store.load(name) or store.store(name, convert(checkpoint.read(name), fmt, group))
            weight = torch.from_numpy(np.array(arrays["weight"]))  # a copy: the store's maps are read-only
            stored = (weight.view(torch.float8_e4m3fn) if fmt == "fp8" else weight,
                      torch.from_numpy(np.array(arrays["scales"])))
        device = torch.device(slot.device)
        return QuantLinear(fmt, group, stored[0].to(device), stored[1].float().to(device), slot.module.in_features,
                           ctx.dtype, widen=self.replaces is not LMHead)


def convert(weight: torch.Tensor, fmt: str, group: int) -> dict[str, np.ndarray]:
    """A weight [out, in] (any float dtype) in fp8 blocks or int4 groups, as arrays for the disk store."""
    if fmt == "fp8":
        w8, scales = fp8_blocks.quantize(weight)
        return {"weight": w8.view(torch.uint8).numpy(), "scales": scales.numpy()}
    values, scales = int_groups.quantize(weight, "int4", group)
    return {"weight": values, "scales": scales}


KWARGS = ("format", "group_size", "cache_dir")
OPERATORS = (
    LinearOperator("linear.triton", Linear, "x W^T with W in fp8 blocks or int4 groups (Triton GEMV/GEMM) or bf16",
                   kwargs=KWARGS),
    LinearOperator("lm_head.triton", LMHead, "output projection with W in fp8, int4 or bf16 (Triton)",
                   kwargs=KWARGS),
)
