"""`experts.numba`: one MoE layer's routed experts in host RAM, computed by numba kernels on the CPU.

Weights are converted once from the checkpoint (bf16 or FP8) into bf16, int8 or int4 (formats/int_groups.py) and
kept in a disk store keyed by the checkpoint and the format; the next start memory-maps them. With the router and
shared expert on the GPU, the hidden state crosses to the CPU once per layer through pinned buffers: begin()
queues that copy, the MoE block then queues the shared expert on the GPU, host() waits for the copy alone (the
one synchronisation) and runs the experts on every core while the GPU works, and finish() queues the result's
copy back. From `gpu_tokens` tokens up (long prefill chunks), the layer runs on the GPU instead: each active
expert's packed weights stream there (expert_ring.py: a copy stream several experts ahead of the matmuls), are
dequantised to the compute dtype (kernels/experts_triton.py) and multiply their tokens; the stored layers' memory
maps are page-locked for that the first time they stream (`pin_experts`), so each expert is one DMA from them.
"""

from collections.abc import Iterable
from itertools import accumulate, chain
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..disk_store import DiskStore
from ..errors import Glm5Error
from ..formats.int_groups import BITS, GROUP, GROUP_SIZES, fitting_group, nbytes, quantize
from ..kernels import experts_triton, moe_cpu
from ..model import Experts, swiglu
from ..util import cache_dir, is_positive_int, span, sync
from .base import Buffer, BuildContext, PlanContext, Slot
from .expert_ring import DEPTH, ExpertRing
from .reference import ExpertsOperator

STORE_VERSION = 2
_pinned: dict[tuple, torch.Tensor] = {}


def pinned(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host buffer of shape [T, ...], shared by every layer (they run one after the other). Buffers come
    in power-of-two row counts from 16 and are never freed: a CUDA graph that captured a copy to one (decode's
    T = 1) finds it where it was, whatever longer chunks came since."""
    rows = max(16, 1 << (shape[0] - 1).bit_length())
    key = (name, rows, tuple(shape[1:]), dtype)
    if key not in _pinned:
        _pinned[key] = torch.empty((rows,) + tuple(shape[1:]), dtype=dtype, pin_memory=True)
    return _pinned[key][: shape[0]]


def expert_store(root: Path, model_dir: Path, fmt: str, group: int) -> DiskStore:
    """Where a checkpoint's experts converted to (fmt, group) are kept: one file per MoE layer."""
    return DiskStore(root, model_dir, {"format": fmt, "group_size": group}, STORE_VERSION)


def convert_layer(slot_name: str, n_experts: int, checkpoint, fmt: str, group: int) -> dict[str, np.ndarray]:
    """Read one layer's experts from the checkpoint and pack them, an expert at a time: w13 = [gate; up], w2 = down.
    (The whole layer stacked and widened at once took several times its fp32 bytes: over 100 GB for a GLM-5 layer.)"""
    packed: dict[str, np.ndarray] = {}
    for e in range(n_experts):
        def read(kind):
            return checkpoint.read(f"{slot_name}.{e}.{kind}_proj.weight")

        v13, s13 = quantize(torch.cat([read("gate"), read("up")]), fmt, group)
        v2, s2 = quantize(read("down"), fmt, group)
        for name, a in (("w13", v13), ("s13", s13), ("w2", v2), ("s2", s2)):
            if name not in packed:  # bf16's scales: the empty array quantize gives, for the whole layer
                packed[name] = np.empty((n_experts, *a.shape), a.dtype) if a.size else a
            if a.size:
                packed[name][e] = a
    return packed


class NumbaExperts(nn.Module):
    """Drop-in for Experts: forward(x, ids, weights), and begin / host / finish for overlap with the GPU."""

    def __init__(self, arrays: dict[str, np.ndarray], fmt: str, group: int, threads: int | None,
                 act_int8: bool = False, gpu_tokens: int | None = None, gpu_ring: int = DEPTH,
                 limit: float | None = None, pin: bool = True):
        super().__init__()
        self.limit = limit  # SwiGLU's clamp (GLM-5.3-Flash)
        self.w13, self.s13, self.w2, self.s2 = (arrays[k] for k in ("w13", "s13", "w2", "s2"))
        self.fmt, self.group, self.threads, self.act_int8 = fmt, group, threads, act_int8
        self.gpu_tokens = gpu_tokens  # chunks of at least this many tokens on a GPU run there; None: never
        self.gpu_ring = gpu_ring  # experts the GPU holds at once for them (expert_ring.py)
        self.pin = pin  # whether the ring page-locks the arrays and transfers from them
        self.next_layer: NumbaExperts | None = None  # whose first experts a long chunk here prefetches (chain_layers)

    def extra_repr(self) -> str:
        return (f"format={self.fmt}, group={self.group}, experts={self.w13.shape[0]}, threads={self.threads}, "
                f"activations={'int8' if self.act_int8 else 'fp32'}")

    def _compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return moe_cpu.moe_forward(self.fmt, self.group, self.w13, self.s13, self.w2, self.s2, x, ids, weights,
                                   threads=self.threads, act_int8=self.act_int8, limit=self.limit)

    def _packed(self) -> dict[str, np.ndarray]:
        names = ("w13", "w2") if self.fmt == "bf16" else ("w13", "s13", "w2", "s2")  # bf16 has no scales
        return {n: getattr(self, n) for n in names}

    def _on_device(self, experts: Iterable[int], device: torch.device):
        """Yield (e, expert e's packed arrays on device): through the GPU's ExpertRing (first the experts of this
        layer it prefetched, then the others of `experts`), or as copies of each of `experts`. Either way
        `experts` is drawn ahead (to its end on the CPU) before the first yield."""
        arrays = self._packed()
        if device.type == "cuda":
            yield from ExpertRing.on(device, arrays, self.gpu_ring, self.pin).stream(self, arrays, experts)
        else:
            yield from ((e, {n: torch.from_numpy(np.array(a[e])) for n, a in arrays.items()}) for e in list(experts))

    def prepare(self, tokens: int, device: torch.device):
        """A forward of `tokens` tokens starts: if they are a long chunk on a GPU, this layer's experts start towards
        it now (the first MoE layer's, under the attention of the layers before it; the chain does the rest)."""
        if device.type == "cuda" and self.gpu_tokens is not None and tokens >= self.gpu_tokens:
            self.prefetch(device)

    def prefetch(self, device: torch.device):
        """Start this layer's first experts towards the GPU's ring, ahead of a long chunk's on_device."""
        arrays = self._packed()
        ExpertRing.on(device, arrays, self.gpu_ring, self.pin).prefetch(self, arrays, range(self.w13.shape[0]))

    def _matrix(self, packed: dict[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        """An expert's w13 ([2I, H]) or w2 ([H, I]) in dtype, from its packed arrays on the device."""
        if self.fmt == "bf16":
            return packed[which].view(torch.bfloat16).to(dtype)
        return experts_triton.dequantize(packed[which], packed[which.replace("w", "s")], self.fmt, self.group,
                                         dtype=dtype)

    def on_device(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts computed on x's device in x's dtype (x [T, H], ids/weights [T, k])."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        inter, k = self.w13.shape[1] // 2, ids.shape[1]
        n_experts, counts, starts = self.w13.shape[0], [], [0]
        ahead = min(self.gpu_ring - 1, n_experts)

        def routed(e: int) -> int:  # the one host sync comes with the first call: after the first copies are queued
            if not counts:  # bincount and tolist wait for the GPU inside a device-to-host copy, which stalls the
                # ring's staging thread until the GPU's queue is done; a scatter and a stream sync let it go on
                flat = ids.flatten()
                per_expert = torch.zeros(n_experts, dtype=flat.dtype, device=flat.device)
                per_expert.scatter_add_(0, flat, torch.ones_like(flat))
                sync(per_expert.device)
                counts.extend(per_expert.tolist())
                starts.extend(accumulate(counts))
            return counts[e]

        # ascending: the first few (or those prefetched) before the host sync, so their copies run under the GPU's queue
        wanted = chain(range(ahead), (e for e in range(ahead, n_experts) if routed(e)))

        with span("experts", x.device):
            order = ids.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
            rows, pair_weights = order // k, weights.flatten()[order, None].float()  # [P], [P, 1]
            for e, packed in self._on_device(wanted, x.device):
                if not routed(e):  # one of the first few, not routed to
                    continue
                a, b = starts[e], starts[e + 1]
                gu = x[rows[a:b]] @ self._matrix(packed, "w13", x.dtype).T
                act = swiglu(gu[:, :inter], gu[:, inter:], self.limit)
                y = act @ self._matrix(packed, "w2", x.dtype).T
                out.index_add_(0, rows[a:b], pair_weights[a:b] * y)
            if self.next_layer is not None and x.is_cuda:  # its transfers start as the matmuls above release slots
                self.next_layer.prefetch(x.device)
        return out.to(x.dtype)

    def begin(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Queue the hidden state's copy to the host (CUDA), or compute at once (CPU, or a long chunk on the GPU)."""
        if x.is_cuda and self.gpu_tokens is not None and x.shape[0] >= self.gpu_tokens:
            return self.on_device(x, ids, weights)
        if not x.is_cuda:
            with span("experts"):
                out = self._compute(x.float().numpy(), ids.numpy(), weights.float().numpy())
            return torch.from_numpy(out).to(x.dtype)
        host = [pinned(n, t.shape, dt) for n, t, dt in
                (("x", x, torch.float32), ("ids", ids, torch.int64), ("w", weights, torch.float32))]
        for buf, t in zip(host, (x, ids, weights)):
            buf.copy_(t, non_blocking=True)
        copied = None
        if not torch.cuda.is_current_stream_capturing():  # a CUDA graph's replayer waits for its piece instead
            copied = torch.cuda.Event()
            copied.record()
        return host, copied, x, pinned("out", x.shape, torch.float32)

    def host(self, pending):
        """The host's part of a GPU chunk: wait for the copy alone (the GPU goes on with what was queued after it),
        then the experts into the pinned output."""
        if isinstance(pending, torch.Tensor):
            return
        (x_host, ids_host, w_host), copied, _, out_host = pending
        if copied is not None:
            with span("transfers"):
                copied.synchronize()
        with span("experts"):
            out_host.copy_(torch.from_numpy(self._compute(x_host.numpy(), ids_host.numpy(), w_host.numpy())))

    def finish(self, pending) -> torch.Tensor:
        """The experts' sum, on the caller's device (its copy back is queued, not waited for)."""
        if isinstance(pending, torch.Tensor):
            return pending
        _, _, x, out_host = pending
        with span("transfers", x.device):
            return out_host.to(x.device, non_blocking=True).to(x.dtype)

    def forward(self, x, ids, weights):
        pending = self.begin(x, ids, weights)
        self.host(pending)
        return self.finish(pending)


def chain_layers(layers: list[NumbaExperts]):
    """Each layer's long chunks prefetch the next one's experts. The last layer's prefetch none: what follows a chunk
    is another chunk only sometimes (a long one prepares its first MoE layer itself), and nothing may be staged
    that nobody uses: the ring's staging thread is idle when a forward returns, so no CUDA call of it can run
    into a CUDA graph's capture (decode's first step)."""
    for layer, following in zip(layers, layers[1:]):
        layer.__dict__["next_layer"] = following  # not a submodule (one module, two parents)


class NumbaExpertsOperator(ExpertsOperator):
    """kwargs: format (bf16 | int8 | int4), group_size (32 | 64 | 128; by default the largest that fits), threads,
    cache_dir, activations (fp32 | int8), gpu_tokens (chunks of this many tokens or more run on the GPU), gpu_ring
    (experts the GPU holds), pin_experts (page-lock the stored experts as they first stream to the GPU: true, the
    default, or false: staged through pinned buffers by a host thread)."""

    def parse_kwargs(self, kwargs: dict) -> dict:
        k = {"format": "int8", "group_size": None, "threads": None, "cache_dir": None, "activations": "fp32",
             "gpu_tokens": None, "gpu_ring": DEPTH, "pin_experts": True, **kwargs}
        if k["format"] not in BITS:
            raise Glm5Error(f"format must be one of {', '.join(BITS)}, got {k['format']!r}")
        if k["group_size"] is not None and k["group_size"] not in GROUP_SIZES:
            raise Glm5Error(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {k['group_size']!r}")
        if k["threads"] is not None and not is_positive_int(k["threads"]):
            raise Glm5Error(f"threads must be a positive integer, got {k['threads']!r}")
        if k["cache_dir"] is not None and not isinstance(k["cache_dir"], str):
            raise Glm5Error(f"cache_dir must be a path, got {k['cache_dir']!r}")
        if k["activations"] not in ("fp32", "int8"):
            raise Glm5Error(f"activations must be fp32 or int8, got {k['activations']!r}")
        if k["activations"] == "int8" and k["format"] == "bf16":
            raise Glm5Error("activations: int8 needs format int8 or int4 (integer dots), not bf16")
        if k["gpu_tokens"] is not None and not is_positive_int(k["gpu_tokens"]):
            raise Glm5Error(f"gpu_tokens must be a positive number of tokens, got {k['gpu_tokens']!r}")
        if not is_positive_int(k["gpu_ring"]) or k["gpu_ring"] < 2:
            raise Glm5Error(f"gpu_ring must be a number of experts, at least 2, got {k['gpu_ring']!r}")
        if not isinstance(k["pin_experts"], bool):
            raise Glm5Error(f"pin_experts must be true or false, got {k['pin_experts']!r}")
        return k

    def check(self, slot: Slot):
        self.packing(slot, torch.bfloat16)

    def packing(self, slot: Slot, dtype: torch.dtype) -> tuple[str, int]:
        """The format, and its group size: the rule's if it divides the experts' inputs (hidden and intermediate
        dims), by default the largest that does."""
        if isinstance(slot.module, NumbaExperts):  # built: what it holds
            return slot.module.fmt, slot.module.group
        fmt, expert = slot.kwargs["format"], slot.module[0]
        if fmt == "bf16":
            return fmt, GROUP
        dims = (expert.gate_proj.in_features, expert.down_proj.in_features)
        return fmt, fitting_group(dims, slot.kwargs["group_size"])

    def weight_bytes(self, slot: Slot, dtype: torch.dtype) -> int:
        return nbytes(sum(t.numel() for t in slot.own_tensors().values()), *self.packing(slot, dtype))

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """With gpu_tokens, on the GPU of the residual stream: the expert ring (one per format, group and depth,
        shared by the layers) and one expert dequantised at a time."""
        buffers = super().memory(slot, ctx)
        if slot.kwargs["gpu_tokens"] and ctx.stream_device != slot.device:
            (fmt, group), depth = self.packing(slot, ctx.dtype), slot.kwargs["gpu_ring"]
            one_expert = 3 * ctx.config.hidden_size * ctx.config.moe_intermediate_size
            buffers += [Buffer(ctx.stream_device, "workspace", depth * nbytes(one_expert, fmt, group),
                               shared=("expert ring", fmt, group, depth)),
                        Buffer(ctx.stream_device, "workspace", one_expert * ctx.dtype.itemsize,
                               shared=("dequantised expert",))]
        return buffers

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> NumbaExperts:
        """Memory-map the stored conversion of this layer's experts, converting it first if needed."""
        k, config = slot.kwargs, ctx.config
        fmt, group = self.packing(slot, ctx.dtype)
        store = expert_store(Path(k["cache_dir"] or cache_dir() / "experts"), ctx.model_dir, fmt, group)
        arrays = store.load(slot.name)
        if arrays is None:
            arrays = store.store(slot.name, convert_layer(slot.name, config.n_routed_experts, checkpoint, fmt, group))
        return NumbaExperts(arrays, fmt, group, k["threads"], k["activations"] == "int8",
                            k["gpu_tokens"], k["gpu_ring"], config.swiglu_limit, k["pin_experts"])

    def link(self, modules: list[NumbaExperts]):
        chain_layers(modules)


NUMBA_EXPERTS = NumbaExpertsOperator(
    "experts.numba", Experts, "routed experts in host RAM (bf16/int8/int4), numba kernels on every core",
    kwargs=("format", "group_size", "threads", "cache_dir", "activations", "gpu_tokens", "gpu_ring", "pin_experts"),
    devices=("cpu",))
