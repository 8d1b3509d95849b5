"""`experts.numba`: one MoE layer's routed experts in host RAM, computed by numba kernels on the CPU.

Weights are converted once from the checkpoint (bf16 or FP8) into bf16, int8 or int4 (formats/int_groups.py) and
kept in a disk store keyed by the checkpoint and the format; the next start reads them into memory of their own
(`in_memory`, the default: a decode step's experts took 2.37 ms from it against 2.91 ms from the file's map on the
H200 machine's host, bench/RESULTS.md) or memory-maps them (`in_memory: false`: pages the OS may drop and read again,
for a host whose RAM the experts do not fit). With the router and
shared expert on the GPU, the hidden state crosses to the CPU once per layer through pinned buffers: begin()
queues that copy, the MoE block then queues the shared expert on the GPU, host() waits for the copy alone (the
one synchronisation) and runs the experts on every core while the GPU works, and finish() queues the result's
copy back. With `decode_gpu_experts: n`, a decode token's last n routed slots run on the GPU (beside(), queued
after the shared expert), their weights read by its kernels from the page-locked host memory over PCIe while the
cores read the others' (kernels/experts_from_host.py): the two reads add up, in part. `decode_gpu_experts: auto`
times a decode token at load with each count up to half the token's experts and keeps the fastest (it pays on some
hosts only: where the cores alone leave the host memory's read unused).
From `gpu_tokens` tokens up (long prefill chunks), the layer runs on the GPU instead: each active
expert's packed weights stream there (expert_ring.py: a copy stream several experts ahead of the matmuls), are
dequantised to the compute dtype (kernels/experts_triton.py) and multiply their tokens (with `activations: int8`,
inputs rounded as the CPU's int8 ones: a chunk's sum is the same wherever each expert ran); the stored layers'
memory is page-locked for that the first time they stream (`pin_experts`), so each expert is one DMA from it.
"""

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path

import numba
import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..disk_store import DiskStore
from ..errors import Glm5Error
from ..formats.int_groups import BITS, GROUP, GROUP_SIZES, fitting_group, nbytes, quantize
from ..kernels import experts_triton, host_stage, moe_cpu
from ..kernels.experts_from_host import GraphedSlots, host_matrices, routed_from_host
from ..kernels.host_read import read_sum
from ..model import Experts
from ..util import cache_dir, is_positive_int, span, sync
from .base import Buffer, BuildContext, PlanContext, Slot
from .expert_ring import DEPTH, ExpertRing, page_locked
from .reference import ExpertsOperator

STORE_VERSION = 2
# GPU chunks below this many tokens split their experts with the CPU: on the H200 machine a GLM-5 layer split took
# 0.52-0.78x the faster side's time at 64-512 tokens, 1.07-2.5x at 1024-8192 (bench_prefill_experts.py); with the
# CPU half two cores short (session 23) 0.75-0.88x at 256-512, 0.60-0.90x at 1024, 0.96x at 2048, 1.82x at 4096
SPLIT_TOKENS = 1024
_pinned: dict[tuple, torch.Tensor] = {}
# a split chunk's CPU half (numba frees the GIL)
_cpu_half = ThreadPoolExecutor(1, thread_name_prefix="experts-cpu-half")
log = logging.getLogger("glm5_offload")


def pinned(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host buffer of shape [T, ...], shared by every layer (they run one after the other). Buffers come
    in power-of-two row counts from 16 and are never freed: a CUDA graph that captured a copy to one (decode's
    T = 1) finds it where it was, whatever longer chunks came since."""
    rows = max(16, 1 << (shape[0] - 1).bit_length())
    key = (name, rows, tuple(shape[1:]), dtype)
    if key not in _pinned:
        _pinned[key] = torch.empty((rows,) + tuple(shape[1:]), dtype=dtype, pin_memory=True)
    return _pinned[key][: shape[0]]


def bound_by_openmp() -> str | None:
    """Why the experts have fewer threads than the machine has cores, where OMP_PROC_BIND or OMP_PLACES is the cause
    (None otherwise: a taskset or cgroup that gives the process fewer cores is the user's choice). With either set,
    the OpenMP runtime that torch loads binds the process's first thread to one place as it loads, and numba counts
    that place's cores: on the H200 machine OMP_PLACES=cores left the experts 1 thread of 16, decode 8x slower."""
    binding = {k: os.environ[k] for k in ("OMP_PROC_BIND", "OMP_PLACES") if k in os.environ}
    threads, cores = numba.config.NUMBA_NUM_THREADS, os.cpu_count() or 1
    unbound = binding.get("OMP_PROC_BIND", "").strip().lower() == "false"  # binds nothing, OMP_PLACES or not
    if not binding or unbound or threads >= cores or "NUMBA_NUM_THREADS" in os.environ:
        return None
    return (f"the CPU experts have {threads} thread{'s' * (threads > 1)} on this machine's {cores} cores: "
            f"{' '.join(f'{k}={v}' for k, v in binding.items())} made the OpenMP runtime bind this process to "
            f"{threads} core{'s' * (threads > 1)} as torch loaded it; unset {' and '.join(binding)} to use every core")


def slow_threading_layer() -> str | None:
    """Why the experts' threads are slow, where numba runs them on its own workqueue layer because it found neither
    OpenMP (libgomp) nor TBB (None otherwise): on the H100 machine's 16-core host a GLM-5 layer's decode took
    1.87-1.95 ms on it against 0.90-0.98 ms on OpenMP (bench/RESULTS.md). Minimal container images lack libgomp.
    A NUMBA_THREADING_LAYER numba cannot load is one line here, not a traceback at the first token."""
    try:
        read_sum(np.ones((1, 1), np.float32))  # numba loads its threading layer at the first parallel call
    except ValueError as e:
        raise Glm5Error(f"NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER}: {str(e).splitlines()[0]}") from None
    if numba.threading_layer() != "workqueue":
        return None
    slow = "the CPU experts run on numba's workqueue threads, about half as fast as on OpenMP's: "
    if numba.config.THREADING_LAYER != "default":  # asked for, or a category (forksafe) that led there
        return slow + f"unset NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER}"
    return slow + ("numba found neither libgomp nor TBB (install libgomp1 with the system's packages, or pip install "
                   "tbb)")


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


class SplitSpeeds:
    """How fast the two halves of a split chunk went, shared by the layers of one expert shape on one device: the
    CPU's (token, expert) pairs per second and the GPU's streamed experts per second. The first chunk starts from a
    guess (the H200 machine's 16-core host, int4 experts, 512 tokens); every chunk measures both, and the next one
    is planned by them."""

    def __init__(self):
        self.cpu_pairs_s, self.gpu_experts_s = 20e3, 1.5e3
        self.gpu: tuple | None = None  # the last chunk's GPU half: (start event, end event, experts), read once done

    def plan(self, counts: list[int], committed: set[int]) -> list[int]:
        """The experts for the CPU: the lightest first (a streamed expert costs its bytes whatever its tokens, the
        CPU's cost grows with them), while the CPU's share stays under what remains on the GPU; never those in
        `committed` (already on their way there)."""
        gpu_s = sum(1 for c in counts if c) / self.gpu_experts_s
        cpu_s, chosen = 0.0, []
        for c, e in sorted((c, e) for e, c in enumerate(counts) if c and e not in committed):
            if cpu_s + c / self.cpu_pairs_s > gpu_s - 1 / self.gpu_experts_s:
                break
            cpu_s, gpu_s = cpu_s + c / self.cpu_pairs_s, gpu_s - 1 / self.gpu_experts_s
            chosen.append(e)
        return chosen

    @staticmethod
    def timer(device: torch.device):
        """A start mark for the GPU half: an event on CUDA (read later, without a sync), else the clock."""
        if device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def gpu_done(self, start, experts: int):
        if not isinstance(start, torch.cuda.Event):
            self._update_gpu(time.perf_counter() - start, experts)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.gpu = (start, end, experts)

    def measured(self):
        """Take in the last chunk's GPU half, done by now (called after a sync)."""
        if self.gpu is not None and self.gpu[1].query():
            start, end, experts = self.gpu
            self._update_gpu(start.elapsed_time(end) / 1e3, experts)
        self.gpu = None

    def _update_gpu(self, seconds: float, experts: int):
        if experts and seconds > 0:
            self.gpu_experts_s = experts / seconds

    def cpu_done(self, seconds: float, pairs: int):
        if pairs and seconds > 0:
            self.cpu_pairs_s = pairs / seconds


_speeds: dict[tuple, SplitSpeeds] = {}
AUTO_RUNS = 24  # decode tokens timed per count for decode_gpu_experts: auto
AUTO_MARGIN = 0.97  # a count more on the GPU must take at most this much of the time of the best with fewer


def fastest_split(medians: dict[int, float]) -> int:
    """decode_gpu_experts: auto's pick from NumbaExperts.decode_split_times: the count with the least time, a count
    more kept only if it beats the best with fewer by the margin (the GPU's share is not taken for noise)."""
    best = 0
    for n in sorted(medians):
        if medians[n] < AUTO_MARGIN * medians[best]:
            best = n
    return best


def split_speeds(layer: "NumbaExperts", device: torch.device) -> SplitSpeeds:
    key = (layer.fmt, layer.group, layer.act_int8, layer.w13.shape, device)
    return _speeds.setdefault(key, SplitSpeeds())


@dataclass
class HostPending:
    """A GPU token chunk's experts between begin and finish."""
    inputs: list[torch.Tensor]  # x (fp32), ids and weights in pinned host memory
    copied: torch.cuda.Event | None  # recorded behind their copy (None in a CUDA graph's capture)
    x: torch.Tensor  # the chunk on the GPU
    out: torch.Tensor  # the host's sum, pinned
    cores: int  # of each token's routed slots, the first `cores` run on the host; the rest on the GPU (beside)
    choice: tuple[torch.Tensor, torch.Tensor]  # ids and weights on the GPU
    gpu: torch.Tensor | None = None  # the GPU's slots' sum, once beside() queued it


class NumbaExperts(nn.Module):
    """Drop-in for Experts: forward(x, ids, weights), and begin / beside / host / finish for overlap with the GPU."""

    def __init__(self, arrays: dict[str, np.ndarray], fmt: str, group: int, threads: int | None,
                 act_int8: bool = False, gpu_tokens: int | None = None, gpu_ring: int = DEPTH,
                 limit: float | None = None, pin: bool = True, split_tokens: int | None = SPLIT_TOKENS,
                 decode_gpu_experts: int | str = 0, top_k: int = 8):
        super().__init__()
        self.limit = limit  # SwiGLU's clamp (GLM-5.3-Flash)
        self.w13, self.s13, self.w2, self.s2 = (arrays[k] for k in ("w13", "s13", "w2", "s2"))
        self.fmt, self.group, self.threads, self.act_int8 = fmt, group, threads, act_int8
        self.gpu_tokens = gpu_tokens  # chunks of at least this many tokens on a GPU run there; None: never
        self.gpu_ring = gpu_ring  # experts the GPU holds at once for them (expert_ring.py)
        self.pin = pin  # whether the ring page-locks the arrays and transfers from them
        self.split_tokens = split_tokens  # GPU chunks of fewer tokens: their lightest experts on the CPU cores too
        self.next_layer: NumbaExperts | None = None  # whose first experts a long chunk here prefetches (chain_layers)
        self.decode_gpu_experts = decode_gpu_experts  # a decode token's last slots the GPU runs from host memory
        self.top_k = top_k  # the routed experts of a token (decode_gpu_experts: auto's counts are up to half of them)
        self.gpu_matrices: tuple | None = None  # w13, s13, w2, s2 as the GPU reads them in place (lock_for_gpu)

    def extra_repr(self) -> str:
        return (f"format={self.fmt}, group={self.group}, experts={self.w13.shape[0]}, threads={self.threads}, "
                f"activations={'int8' if self.act_int8 else 'fp32'}, split_tokens={self.split_tokens}, "
                f"decode_gpu_experts={self.decode_gpu_experts}")

    def lock_for_gpu(self) -> bool:
        """Page-lock the arrays for the GPU's decode slots (whether the GPU reads them in place; else those slots
        stay on the cores)."""
        locked = all(page_locked(a) for a in self._packed().values())
        self.gpu_matrices = host_matrices(self.w13, self.s13, self.w2, self.s2) if locked else None
        return locked

    def decode_split_times(self, runs: int = AUTO_RUNS) -> dict[int, float]:
        """A decode token's experts (random input and choice, new each run) timed with 0 .. top_k // 2 of them on the
        GPU, its part replayed from a CUDA graph as a decode step's is, the cores' part at once; the counts in turn
        within each run (a host's drift falls on all): count -> median seconds."""
        hidden, experts, k = self.w2.shape[1], self.w13.shape[0], self.top_k
        graphed = lambda n: GraphedSlots(self.gpu_matrices, self.fmt, self.group, self.act_int8,  # noqa: E731
                                         self.limit, k, n)
        parts = {n: graphed(n) if n else None for n in range(k // 2 + 1)}
        rng = np.random.default_rng(0)
        times: dict[int, list[float]] = {n: [] for n in parts}
        for run in range(runs + 1):  # the first warms the cores' kernel: left out
            for n, part in parts.items():
                x = rng.standard_normal((1, hidden), np.float32)
                ids, weights = rng.permutation(experts)[None, :k], rng.random((1, k), np.float32)
                if part:
                    part.choose(x, ids, weights)
                t0 = time.perf_counter()
                if part:
                    part.replay()
                self._compute(x, np.ascontiguousarray(ids[:, :k - n]), np.ascontiguousarray(weights[:, :k - n]))
                torch.cuda.synchronize()
                if run:
                    times[n].append(time.perf_counter() - t0)
        return {n: float(np.median(seconds)) for n, seconds in times.items()}

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

    def _matrix(self, packed: dict[str, torch.Tensor], which: str, out: torch.Tensor) -> torch.Tensor:
        """An expert's w13 ([2I, H]) or w2 ([H, I]) in out's dtype, from its packed arrays on the device (into out,
        or a view of them: bf16 in bf16)."""
        if self.fmt == "bf16":
            matrix = packed[which].view(torch.bfloat16)
            return matrix if out.dtype == torch.bfloat16 else out.copy_(matrix)
        return experts_triton.dequantize(packed[which], packed[which.replace("w", "s")], self.fmt, self.group, out)

    def on_device(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts computed on x's device in x's dtype (x [T, H], ids/weights [T, k]); below `split_tokens`
        tokens, the lightest experts (fewest tokens) by the CPU cores at the same time, as many as their measured
        speeds balance."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        inter, k = self.w13.shape[1] // 2, ids.shape[1]
        n_experts, counts, starts = self.w13.shape[0], [], [0]
        ahead = min(self.gpu_ring - 1, n_experts)
        speeds = split_speeds(self, x.device) if self.split_tokens and x.shape[0] < self.split_tokens else None
        committed = set(range(ahead))  # drawn before the routing is known: on the device whatever the split
        if x.is_cuda:
            committed |= ExpertRing.on(x.device, self._packed(), self.gpu_ring, self.pin).staged_for(self)
        on_cpu: set[int] = set()
        cpu_half: list[Future] = []

        def routed(e: int) -> int:  # the one host sync comes with the first call: after the first copies are queued
            if not counts:  # bincount and tolist wait for the GPU inside a device-to-host copy, which stalls the
                # ring's staging thread until the GPU's queue is done; a scatter and a stream sync let it go on
                flat = ids.flatten()
                per_expert = torch.zeros(n_experts, dtype=flat.dtype, device=flat.device)
                per_expert.scatter_add_(0, flat, torch.ones_like(flat))
                sync(per_expert.device)
                counts.extend(per_expert.tolist())
                starts.extend(accumulate(counts))
                if speeds:
                    speeds.measured()
                    on_cpu.update(speeds.plan(counts, committed))
                if on_cpu:  # the inputs to the host (a second, short wait: the copies come next in the queue)
                    inputs = self._to_host(x, ids, weights, "split ")
                    sync(x.device)
                    pairs = sum(counts[e] for e in on_cpu)
                    cpu_half.append(_cpu_half.submit(self._cpu_half, *inputs, sorted(on_cpu), pairs, x.device, speeds))
            return counts[e] and e not in on_cpu

        # ascending: the first few (or those prefetched) before the host sync, so their copies run under the GPU's queue
        wanted = chain(range(ahead), (e for e in range(ahead, n_experts) if routed(e)))

        with span("experts", x.device):
            # int8 activations: both projections take the values the CPU's int8 inputs stand for, so the chunk's sum
            # does not depend on which experts ran where (a split chunk, CPU decode), up to the dtype's rounding
            xq = experts_triton.round_activations(x, self.group) if self.act_int8 else x
            order = ids.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
            rows, pair_weights = order // k, weights.flatten()[order, None].float()  # [P], [P, 1]
            timer = speeds.timer(x.device) if speeds else None
            # one expert dequantised at a time (the stream orders each one's use before the next overwrites them)
            w13 = torch.empty(2 * inter, x.shape[1], dtype=x.dtype, device=x.device)
            w2 = torch.empty(x.shape[1], inter, dtype=x.dtype, device=x.device)
            for e, packed in self._on_device(wanted, x.device):
                if not routed(e):  # one of the first few, not routed to
                    continue
                a, b = starts[e], starts[e + 1]
                gu = xq[rows[a:b]] @ self._matrix(packed, "w13", w13).T
                act = experts_triton.swiglu(gu, self.limit, self.group, self.act_int8)
                y = act @ self._matrix(packed, "w2", w2).T
                out.index_add_(0, rows[a:b], pair_weights[a:b] * y)
            if speeds:
                speeds.gpu_done(timer, sum(1 for e, c in enumerate(counts) if c and e not in on_cpu))
            if self.next_layer is not None and x.is_cuda:  # its transfers start as the matmuls above release slots
                self.next_layer.prefetch(x.device)
            if cpu_half:
                out += cpu_half[0].result().to(x.device, non_blocking=True)
        return out.to(x.dtype)

    @staticmethod
    def _to_host(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, prefix: str = "") -> list[torch.Tensor]:
        """x (fp32), ids and weights queued to the pinned host buffers named `prefix` + x, ids, w, by one kernel (as
        they are, from the CPU)."""
        if not x.is_cuda:
            return [x.float(), ids, weights.float()]
        host = [pinned(prefix + n, t.shape, dt) for n, t, dt in
                (("x", x, torch.float32), ("ids", ids, torch.int64), ("w", weights, torch.float32))]
        if ids.device == weights.device == x.device:
            host_stage.stage(x, ids, weights, *host)
        else:  # a router that a rule file placed elsewhere: its outputs copied as they are
            for buf, t in zip(host, (x, ids, weights)):
                buf.copy_(t, non_blocking=True)
        return host

    def _cpu_half(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[int], pairs: int,
                  device: torch.device, speeds: "SplitSpeeds") -> torch.Tensor:
        """On the CPU-half thread: the routed output of `experts` (their `pairs` (token, expert) pairs) alone
        ([T, H] fp32, pinned for a GPU), timed.
        Two cores fewer than the layer's threads: one for the caller's thread, which queues the GPU's half meanwhile,
        one spare. With only the caller's left (15 of 16 on the H200 machine), a GLM-5 layer's 512-token split took
        a median 97.8-110.5 ms, its halves waiting on whichever thread was preempted; with 14 or 12, 74.6-74.8 ms
        (bench_prefill_experts.py --split-runs 7, one call)."""
        t0 = time.perf_counter()
        threads = max(1, (self.threads or numba.config.NUMBA_NUM_THREADS) - 2)
        result = torch.from_numpy(moe_cpu.moe_forward(
            self.fmt, self.group, self.w13, self.s13, self.w2, self.s2, x.numpy(), ids.numpy(), weights.numpy(),
            threads=threads, act_int8=self.act_int8, limit=self.limit, only=np.array(experts, np.int64)))
        if device.type == "cuda":
            result = pinned("split out", tuple(result.shape), torch.float32).copy_(result)
        speeds.cpu_done(time.perf_counter() - t0, pairs)
        return result

    def begin(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Queue the hidden state's copy to the host (CUDA), or compute at once (CPU, or a long chunk on the GPU)."""
        if x.is_cuda and self.gpu_tokens is not None and x.shape[0] >= self.gpu_tokens:
            return self.on_device(x, ids, weights)
        if not x.is_cuda:
            with span("experts"):
                out = self._compute(x.float().numpy(), ids.numpy(), weights.float().numpy())
            return torch.from_numpy(out).to(x.dtype)
        host = self._to_host(x, ids, weights)
        copied = None
        if not torch.cuda.is_current_stream_capturing():  # a CUDA graph's replayer waits for its piece instead
            copied = torch.cuda.Event()
            copied.record()
        on_gpu = x.shape[0] == 1 and self.gpu_matrices is not None and ids.device == weights.device == x.device
        gpu = self.decode_gpu_experts if on_gpu else 0  # (not where a rule placed the router off the GPU)
        return HostPending(host, copied, x, pinned("out", x.shape, torch.float32), ids.shape[1] - gpu, (ids, weights))

    def beside(self, pending):
        """Queue the GPU's slots of a decode token (decode_gpu_experts), to run while the host runs the others."""
        if isinstance(pending, HostPending) and pending.cores < pending.choice[0].shape[1]:
            with span("experts", pending.x.device):
                pending.gpu = routed_from_host(pending.x, *pending.choice, pending.cores, self.gpu_matrices, self.fmt,
                                               self.group, self.act_int8, self.limit)

    def host(self, pending):
        """The host's part of a GPU chunk: wait for the copy alone (the GPU goes on with what was queued after it),
        then the experts of the slots it runs into the pinned output."""
        if isinstance(pending, torch.Tensor):
            return
        x_host, ids_host, w_host = pending.inputs
        if pending.copied is not None:
            with span("transfers"):
                pending.copied.synchronize()
        slots = slice(None, pending.cores)
        with span("experts"):
            ids, weights = (np.ascontiguousarray(t.numpy()[:, slots]) for t in (ids_host, w_host))
            pending.out.copy_(torch.from_numpy(self._compute(x_host.numpy(), ids, weights)))

    def finish(self, pending) -> torch.Tensor:
        """The experts' sum, on the caller's device (its copy back is queued, not waited for); from the host in fp32,
        as computed (plus the GPU's slots' sum, fp32): the norm that adds it to the residual stream rounds it to the
        stream's dtype in its kernel (blocks.summed), one kernel fewer between the experts and the next layer."""
        if isinstance(pending, torch.Tensor):
            return pending
        with span("transfers", pending.x.device):
            out = pending.out.to(pending.x.device, non_blocking=True)
        return out if pending.gpu is None else out.add_(pending.gpu)

    def forward(self, x, ids, weights):
        pending = self.begin(x, ids, weights)
        self.beside(pending)
        self.host(pending)
        return self.finish(pending).to(x.dtype)


def chain_layers(layers: list[NumbaExperts]):
    """Each layer's long chunks prefetch the next one's experts. The last layer's prefetch none: what follows a chunk
    is another chunk only sometimes (a long one prepares its first MoE layer itself), and nothing may be staged
    that nobody uses: the ring's staging thread is idle when a forward returns, so no CUDA call of it can run
    into a CUDA graph's capture (decode's first step)."""
    for layer, following in zip(layers, layers[1:]):
        layer.__dict__["next_layer"] = following  # not a submodule (one module, two parents)


class NumbaExpertsOperator(ExpertsOperator):
    """kwargs: format (bf16 | int8 | int4), group_size (32 | 64 | 128; by default the largest that fits), threads,
    cache_dir, activations (fp32 | int8: both projections' inputs in int8 groups, wherever the experts run),
    gpu_tokens (chunks of this many tokens or more run on the GPU), gpu_ring (experts the GPU holds), pin_experts
    (page-lock the stored experts as they first stream to the GPU: true, the default, or false: staged through
    pinned buffers by a host thread), split_tokens (GPU chunks of fewer tokens give their lightest experts to the CPU
    cores at the same time; default 1024, null: never), in_memory (read the stored experts into memory at load: true,
    the default, or memory-map them: false), decode_gpu_experts (of a decode token's routed experts, how many the GPU
    computes beside the cores, reading their weights from host memory, page-locked at load; default 0: none; auto:
    the fastest count, timed at load, of 0 up to half the token's experts)."""

    def parse_kwargs(self, kwargs: dict) -> dict:
        k = {"format": "int8", "group_size": None, "threads": None, "cache_dir": None, "activations": "fp32",
             "gpu_tokens": None, "gpu_ring": DEPTH, "pin_experts": True, "split_tokens": SPLIT_TOKENS,
             "in_memory": True, "decode_gpu_experts": 0, **kwargs}
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
        for name in ("pin_experts", "in_memory"):
            if not isinstance(k[name], bool):
                raise Glm5Error(f"{name} must be true or false, got {k[name]!r}")
        if k["split_tokens"] is not None and not is_positive_int(k["split_tokens"]):
            raise Glm5Error(f"split_tokens must be a positive number of tokens or null, got {k['split_tokens']!r}")
        n = k["decode_gpu_experts"]
        if n != "auto" and (type(n) is not int or n < 0):  # (not YAML's true or false)
            raise Glm5Error(f"decode_gpu_experts must be a number of experts (0: none) or auto, got {n!r}")
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

    @staticmethod
    def decode_gpu_experts(slot: Slot, stream_device: str, top_k: int) -> int | str:
        """The rule's decode_gpu_experts for a residual stream on stream_device and top_k experts a token: auto means
        none off a GPU; a count must leave the cores some (fewer than top_k) and needs the stream on a GPU."""
        n = slot.kwargs["decode_gpu_experts"]
        if n == "auto":
            return n if stream_device.startswith("cuda") else 0
        if n >= top_k:
            raise Glm5Error(f"decode_gpu_experts: {n} leaves the CPU cores none of the {top_k} experts a token routes "
                            f"to; at most {top_k - 1}")
        if n and not stream_device.startswith("cuda"):
            raise Glm5Error(f"decode_gpu_experts: {n} runs experts on the GPU of the residual stream, but the rules "
                            f"put it on {stream_device} (model.embed_tokens' device)")
        return n

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """With gpu_tokens, on the GPU of the residual stream: the expert ring (one per format, group and depth,
        shared by the layers) and one expert dequantised at a time; with decode_gpu_experts (fewer than the experts a
        token routes to, or refused here), a decode token's gate, up, SwiGLU and sum of those experts there."""
        buffers = super().memory(slot, ctx)
        config = ctx.config
        gpu_experts = self.decode_gpu_experts(slot, ctx.stream_device, config.num_experts_per_tok)
        if gpu_experts == "auto":
            gpu_experts = config.num_experts_per_tok // 2
        if gpu_experts:  # a decode token's gate and up, SwiGLU and sum
            inter = config.moe_intermediate_size
            buffers.append(Buffer(ctx.stream_device, "workspace", 4 * (gpu_experts * 3 * inter + config.hidden_size)))
        if slot.kwargs["gpu_tokens"] and ctx.stream_device != slot.device:
            (fmt, group), depth = self.packing(slot, ctx.dtype), slot.kwargs["gpu_ring"]
            one_expert = 3 * ctx.config.hidden_size * ctx.config.moe_intermediate_size
            buffers += [Buffer(ctx.stream_device, "workspace", depth * nbytes(one_expert, fmt, group),
                               shared=("expert ring", fmt, group, depth)),
                        Buffer(ctx.stream_device, "workspace", one_expert * ctx.dtype.itemsize,
                               shared=("dequantised expert",))]
        return buffers

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> NumbaExperts:
        """Read (or memory-map) the stored conversion of this layer's experts, converting it first if needed."""
        k, config = slot.kwargs, ctx.config
        if k["threads"] is not None and k["threads"] > numba.config.NUMBA_NUM_THREADS:  # here, not at the rule: a
            # placement may be planned on another machine than the one that runs it
            raise Glm5Error(f"threads: {k['threads']} is more than the {numba.config.NUMBA_NUM_THREADS} cores numba "
                            "may use in this process (NUMBA_NUM_THREADS)")
        fmt, group = self.packing(slot, ctx.dtype)
        store = expert_store(Path(k["cache_dir"] or cache_dir() / "experts"), ctx.model_dir, fmt, group)
        arrays = store.load(slot.name, k["in_memory"])
        if arrays is None:
            arrays = store.store(slot.name, convert_layer(slot.name, config.n_routed_experts, checkpoint, fmt, group),
                                 k["in_memory"])
        return NumbaExperts(arrays, fmt, group, k["threads"], k["activations"] == "int8",
                            k["gpu_tokens"], k["gpu_ring"], config.swiglu_limit, k["pin_experts"], k["split_tokens"],
                            self.decode_gpu_experts(slot, ctx.stream_device, config.num_experts_per_tok),
                            config.num_experts_per_tok)

    def link(self, modules: list[NumbaExperts]):
        chain_layers(modules)
        sharing = [m for m in modules if m.decode_gpu_experts]
        if sharing and torch.cuda.is_available():
            locked = sum(m.lock_for_gpu() for m in tqdm(sharing, desc="page-locking experts", unit="layer",
                                                         disable=None))
            if locked < len(sharing):
                log.warning("decode_gpu_experts: %d of %d layers' experts could not be page-locked: their decode "
                            "tokens run every expert on the CPU cores", len(sharing) - locked, len(sharing))
        auto = [m for m in sharing if m.decode_gpu_experts == "auto"]
        timed = next((m for m in auto if m.gpu_matrices is not None), None)
        chosen = 0
        if timed is not None:
            medians = timed.decode_split_times()
            chosen = fastest_split(medians)
            log.info("decode_gpu_experts: auto runs %d of a decode token's %d experts on the GPU (a token's ms with "
                     "0, 1, ... of them there: %s)", chosen, timed.top_k,
                     ", ".join(f"{t * 1e3:.2f}" for t in medians.values()))
        for m in auto:  # (0 where the experts are not page-locked: no GPU, or a refusal)
            m.decode_gpu_experts = chosen if m.gpu_matrices is not None else 0
        for problem in (bound_by_openmp(), slow_threading_layer()):
            if problem:
                log.warning("%s", problem)


NUMBA_EXPERTS = NumbaExpertsOperator(
    "experts.numba", Experts, "routed experts in host RAM (bf16/int8/int4), numba kernels on every core",
    kwargs=("format", "group_size", "threads", "cache_dir", "activations", "gpu_tokens", "gpu_ring", "pin_experts",
            "split_tokens", "in_memory", "decode_gpu_experts"),
    devices=("cpu",))
