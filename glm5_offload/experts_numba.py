"""`experts.numba`: one MoE layer's routed experts in host RAM, computed by numba kernels on the CPU.

Weights are converted once from the checkpoint (bf16 or FP8) into bf16, int8 or int4 and cached on
disk as safetensors plus a manifest keyed by the source checkpoint and the format; the next start
memory-maps the cache. With the router and shared expert on the GPU, the hidden state crosses to the
CPU once per layer through pinned buffers: begin() queues that copy, the MoE block then queues the
shared expert on the GPU, and finish() waits for the copy alone (the one synchronisation), runs the
experts on every core while the GPU works, and queues the result's copy back. From `gpu_tokens` tokens
up (long prefill chunks), the layer runs on the GPU instead: each active expert's packed weights stream
there (expert_ring.py: a copy stream several experts ahead of the matmuls), are dequantised to the
compute dtype (kernels/experts_triton.py) and multiply their tokens.
"""

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from torch import nn

from . import cache_dir
from .errors import Glm5Error
from .expert_ring import DEPTH, ExpertRing
from .kernels import experts_triton, moe_cpu
from .model import Experts
from .operators import Operator, is_positive_int
from .timeline import span

CACHE_VERSION = 1
_NUMPY = {"I8": np.int8, "U8": np.uint8, "U16": np.uint16, "F32": np.float32}


def source_fingerprint(model_dir: Path) -> str:
    """Identifies the checkpoint's bytes: its files' names, sizes and modification times."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def memory_map(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory map (nothing is read until used)."""
    from .loader import check_shard  # the loader imports the registry, which imports this module

    n, header = check_shard(path)
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arrays[name] = np.memmap(path, dtype=_NUMPY[info["dtype"]], mode="r", offset=8 + n + start,
                                 shape=tuple(info["shape"])) if end > start else np.zeros(info["shape"], _NUMPY[info["dtype"]])
    return arrays


@dataclass
class ExpertCache:
    """One folder per (checkpoint, format, group size): a manifest and one safetensors file per layer."""

    root: Path
    model_dir: Path
    fmt: str
    group: int

    @property
    def folder(self) -> Path:
        key = json.dumps([str(self.model_dir.resolve()), self.fmt, self.group, CACHE_VERSION])
        return self.root / hashlib.sha256(key.encode()).hexdigest()[:16]

    def manifest(self) -> dict:
        try:
            manifest = json.loads((self.folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        same = manifest.get("fingerprint") == source_fingerprint(self.model_dir) and manifest.get("version") == CACHE_VERSION
        return manifest if same else {}

    def load(self, slot_name: str) -> dict[str, np.ndarray] | None:
        file = self.manifest().get("layers", {}).get(slot_name)
        if file is None or not (self.folder / file).is_file():
            return None
        return memory_map(self.folder / file)

    def store(self, slot_name: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.folder.mkdir(parents=True, exist_ok=True)
        file = f"{slot_name}.safetensors"
        tmp = self.folder / f".{file}.tmp"
        save_file(arrays, str(tmp))
        os.replace(tmp, self.folder / file)
        manifest = self.manifest() or {
            "source": str(self.model_dir.resolve()), "fingerprint": source_fingerprint(self.model_dir),
            "format": self.fmt, "group_size": self.group, "version": CACHE_VERSION, "layers": {}}
        manifest["layers"][slot_name] = file
        tmp = self.folder / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, self.folder / "manifest.json")
        return memory_map(self.folder / file)


def convert_layer(slot_name: str, n_experts: int, hidden: int, inter: int, tensors, fmt: str, group: int):
    """Read one layer's experts from the checkpoint and quantise them: w13 = [gate; up], w2 = down."""
    def stacked(kind, shape):
        return torch.stack([tensors.get(f"{slot_name}.{e}.{kind}_proj.weight", shape) for e in range(n_experts)])

    w13 = torch.cat([stacked("gate", (inter, hidden)), stacked("up", (inter, hidden))], dim=1)
    v13, s13 = moe_cpu.quantize(w13, fmt, group)
    v2, s2 = moe_cpu.quantize(stacked("down", (hidden, inter)), fmt, group)
    return {"w13": v13, "s13": s13, "w2": v2, "s2": s2}


class NumbaExperts(nn.Module):
    """Drop-in for Experts: forward(x, ids, weights), and begin()/finish() for overlap with the GPU."""

    def __init__(self, arrays: dict[str, np.ndarray], fmt: str, group: int, threads: int | None,
                 act_int8: bool = False, gpu_tokens: int | None = None, gpu_ring: int = DEPTH):
        super().__init__()
        self.w13, self.s13, self.w2, self.s2 = (arrays[k] for k in ("w13", "s13", "w2", "s2"))
        self.fmt, self.group, self.threads, self.act_int8 = fmt, group, threads, act_int8
        self.gpu_tokens = gpu_tokens  # chunks of at least this many tokens on a GPU run there; None: never
        self.gpu_ring = gpu_ring  # experts the GPU holds at once for them (expert_ring.py)
        self.next_layer: NumbaExperts | None = None  # whose first experts a long chunk here prefetches (chain_layers)
        self._pinned: dict[str, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (f"format={self.fmt}, group={self.group}, experts={self.w13.shape[0]}, threads={self.threads}, "
                f"activations={'int8' if self.act_int8 else 'fp32'}")

    def _compute(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return moe_cpu.moe_forward(self.fmt, self.group, self.w13, self.s13, self.w2, self.s2, x, ids, weights,
                                   threads=self.threads, act_int8=self.act_int8)

    def _buffer(self, name: str, shape, dtype) -> torch.Tensor:
        buf = self._pinned.get(name)
        if buf is None or buf.shape[0] < shape[0]:
            buf = torch.empty((max(shape[0], 16),) + tuple(shape[1:]), dtype=dtype, pin_memory=True)
            self._pinned[name] = buf
        return buf[: shape[0]]

    def _packed(self) -> dict[str, np.ndarray]:
        names = ("w13", "w2") if self.fmt == "bf16" else ("w13", "s13", "w2", "s2")  # bf16 has no scales
        return {n: getattr(self, n) for n in names}

    def _on_device(self, experts: Iterable[int], device: torch.device):
        """Yield (e, expert e's packed arrays on device): through the GPU's ExpertRing (first the experts of this
        layer it prefetched, then the others of `experts`), or as copies of each of `experts`. Either way
        `experts` is drawn ahead (to its end on the CPU) before the first yield."""
        arrays = self._packed()
        if device.type == "cuda":
            yield from ExpertRing.on(device, arrays, self.gpu_ring).stream(self, arrays, experts)
        else:
            yield from ((e, {n: torch.from_numpy(np.array(a[e])) for n, a in arrays.items()}) for e in list(experts))

    def prefetch(self, device: torch.device):
        """Start this layer's first experts towards the GPU's ring, ahead of a long chunk's on_device."""
        arrays = self._packed()
        ExpertRing.on(device, arrays, self.gpu_ring).prefetch(self, arrays, range(self.w13.shape[0]))

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
                if per_expert.is_cuda:
                    torch.cuda.current_stream(per_expert.device).synchronize()
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
                act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
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
        host = [self._buffer(n, t.shape, dt) for n, t, dt in
                (("x", x, torch.float32), ("ids", ids, torch.int64), ("w", weights, torch.float32))]
        for buf, t in zip(host, (x, ids, weights)):
            buf.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied, x

    def finish(self, pending) -> torch.Tensor:
        """The experts' sum, on the caller's device (its copy back is queued, not waited for)."""
        if isinstance(pending, torch.Tensor):
            return pending
        (x_host, ids_host, w_host), copied, x = pending
        with span("transfers"):
            copied.synchronize()  # the copy only: the GPU goes on with whatever was queued after it
        out_host = self._buffer("out", x_host.shape, torch.float32)
        self.compute_host(x_host, ids_host, w_host, out_host)
        with span("transfers", x.device):
            return out_host.to(x.device, non_blocking=True).to(x.dtype)

    def compute_host(self, x_host, ids_host, w_host, out_host):
        """The experts' sum for host tensors x [T, H] fp32, ids [T, k] int64, weights [T, k] fp32, into out_host."""
        with span("experts"):
            out_host.copy_(torch.from_numpy(self._compute(x_host.numpy(), ids_host.numpy(), w_host.numpy())))

    def forward(self, x, ids, weights):
        return self.finish(self.begin(x, ids, weights))


def chain_layers(layers: list[NumbaExperts]):
    """Each layer's long chunks prefetch the next one's experts; the last layer's, the first's (the next chunk's)."""
    for layer, following in zip(layers, layers[1:] + layers[:1]):
        layer.__dict__["next_layer"] = following  # not a submodule (one module, two parents)


class NumbaExpertsOperator(Operator):
    def check_kwargs(self, kwargs: dict) -> str | None:
        fmt = kwargs.get("format", "int8")
        if fmt not in moe_cpu.FORMATS:
            return f"format must be one of {', '.join(moe_cpu.FORMATS)}, got {fmt!r}"
        group = kwargs.get("group_size", 128)
        if group not in moe_cpu.GROUP_SIZES:
            return f"group_size must be one of {', '.join(map(str, moe_cpu.GROUP_SIZES))}, got {group!r}"
        threads = kwargs.get("threads")
        if threads is not None and not is_positive_int(threads):
            return f"threads must be a positive integer, got {threads!r}"
        if not isinstance(kwargs.get("cache_dir", ""), str):
            return f"cache_dir must be a path, got {kwargs['cache_dir']!r}"
        activations = kwargs.get("activations", "fp32")
        if activations not in ("fp32", "int8"):
            return f"activations must be fp32 or int8, got {activations!r}"
        if activations == "int8" and fmt == "bf16":
            return "activations: int8 needs format int8 or int4 (integer dots), not bf16"
        gpu_tokens = kwargs.get("gpu_tokens")
        if gpu_tokens is not None and not is_positive_int(gpu_tokens):
            return f"gpu_tokens must be a positive number of tokens, got {gpu_tokens!r}"
        gpu_ring = kwargs.get("gpu_ring", DEPTH)
        if not is_positive_int(gpu_ring) or gpu_ring < 2:
            return f"gpu_ring must be a number of experts, at least 2, got {gpu_ring!r}"
        return None

    def format(self, kwargs: dict, dtype: torch.dtype) -> str:
        fmt = kwargs.get("format", "int8")
        return fmt if fmt == "bf16" else f"{fmt}/g{kwargs.get('group_size', 128)}"

    def weight_bytes(self, module, kwargs, dtype, skip=()) -> int:
        from .planner import expert_bytes

        n = sum(p.numel() for p in module.parameters())
        fmt, group = kwargs.get("format", "int8"), kwargs.get("group_size", 128)
        return expert_bytes(n, fmt, group)

    def build(self, slot, tensors, config, model_dir: Path) -> NumbaExperts:
        """Memory-map the cached conversion of this layer's experts, converting it first if needed."""
        fmt, group = slot.kwargs.get("format", "int8"), slot.kwargs.get("group_size", 128)
        for dim in (config.hidden_size, config.moe_intermediate_size):
            if fmt != "bf16" and dim % group:
                raise Glm5Error(f"experts.numba: group_size {group} does not divide the expert dim {dim}")
        cache = ExpertCache(Path(slot.kwargs.get("cache_dir") or cache_dir() / "experts"), model_dir, fmt, group)
        arrays = cache.load(slot.name)
        if arrays is None:
            arrays = cache.store(slot.name, convert_layer(
                slot.name, config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, tensors, fmt, group))
        return NumbaExperts(arrays, fmt, group, slot.kwargs.get("threads"), slot.kwargs.get("activations") == "int8",
                            slot.kwargs.get("gpu_tokens"), slot.kwargs.get("gpu_ring", DEPTH))


NUMBA_EXPERTS = NumbaExpertsOperator(
    "experts.numba", Experts, "routed experts in host RAM (bf16/int8/int4), numba kernels on every core",
    kwargs=("format", "group_size", "threads", "cache_dir", "activations", "gpu_tokens", "gpu_ring"),
    devices=("cpu",))
