"""Decode from CUDA graphs: one token a step, the model's own forward steps replayed in a few launches per MoE layer.

In eager mode a GLM-5 layer issues some 200 kernels, and Python's cost of launching them is many times the
GPU's work; with the routed experts on the CPU the step is then Python + GPU + CPU experts, one after the
other. Here the model's forward steps (CausalLM.steps, model/steps.py) are cut where the host takes part, and
each stretch of GPU steps between cuts is captured as a graph. For a MoE layer i with CPU experts:

    A_i  the previous layer's expert sum (H2D from a pinned buffer) and shared expert + residual, norm,
         attention (indexer, top-k, tiered fetch, sparse MLA), residual, norm, router, and the experts' input,
         choice and weights written into pinned buffers                                        (up to the CUT)
    B_i  the shared expert (and the routed slots the GPU runs from host memory: decode_gpu_experts), which the
         GPU runs while the CPU runs the routed experts                                     (up to the HostStep)

The host replays A_i and B_i, and A_{i+1} too, which starts by waiting on the GPU for the host's signal
(kernels/host_signal.py); it waits for A_i alone (the one synchronisation of the layer), runs the routed experts on
every core into a pinned buffer (the HostStep) and gives the signal: A_{i+1} runs as soon as the experts are done,
its launch already paid while the GPU ran A_i. Dense layers join the piece they sit in; the final norm and lm_head
are the last piece.

Nothing in a piece depends on a host-side position: the token and its position live in device tensors, and keys
and rows are read up to a bucket bound (a power of two >= the context), masked past the position. One set of
graphs serves every position of its bucket; a new bucket is captured at its first step: one eager pass of the
steps (kernels compiled, workspaces allocated), the capture of every piece, then the replay, so that step's
cache writes and LRU updates happen twice, harmlessly. With capture=False the same pieces run eagerly: the CPU
tests check the cut against the model's forward.
"""

import time
from dataclasses import dataclass, field

import torch

from ..kernels.host_signal import HostSignal
from ..model import CUT, CausalLM, HostStep, MoE, Pass, run_steps
from ..ops.experts_numba import NumbaExperts
from .kv_cache import KVCache

MIN_BUCKET = 4096  # smallest key bound: below it, reading more keys costs less than more graphs


def unsupported(model: CausalLM) -> str | None:
    """Why this placement cannot decode from CUDA graphs (None: it can)."""
    if model.device.type != "cuda":
        return "the model's residual stream is not on a GPU"
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE) and not isinstance(layer.mlp.experts, NumbaExperts):
            return f"layer {i}'s routed experts are not experts.numba (only CPU experts are cut out of the graphs)"
        if isinstance(layer.mlp, MoE) and layer.mlp.experts.gpu_tokens == 1:
            return f"layer {i}'s routed experts stream to the GPU from 1 token (gpu_tokens: 1), decode steps too"
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != model.device and not t.is_pinned():  # a copy between devices inside a piece would need the
            # host; pinned host tensors (embedding.host's table) are read by the GPU in place
            return f"{name} is on {t.device}, not on the residual stream's {model.device}"
    return None


@dataclass
class Piece:
    steps: list = field(default_factory=list)  # GPU steps, replayed as one graph
    cut: bool = False  # the host's next wait covers this piece and those before it
    host: HostStep | None = None  # after the piece: the host waits for the last cut, then does this
    after_host: bool = False  # the piece follows a host step: its graph starts by waiting for the host's signal
    graph: torch.cuda.CUDAGraph | None = None
    done: torch.cuda.Event | None = None  # a cut piece's, recorded by its graph's last node: each replay re-records it
    # for free (an event recorded from the host after the replay cost 35-42 us of host time a MoE layer, H200 machine)


def pieces(steps: list) -> list[Piece]:
    """Steps cut at each CUT and HostStep into pieces of GPU steps."""
    out = [Piece()]
    for step in steps:
        if step is CUT:
            out[-1].cut = True
        elif isinstance(step, HostStep):
            out[-1].host = step
        else:
            if out[-1].cut or out[-1].host:
                out.append(Piece(after_host=out[-1].host is not None))
            out[-1].steps.append(step)
    return out


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: KVCache, capture: bool = True, min_bucket: int = MIN_BUCKET):
        self.model, self.cache, self.capture, self.min_bucket = model, cache, capture, min_bucket
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.positions = torch.zeros(1, dtype=torch.long, device=model.device)
        self.buckets: dict[int, tuple[list[Piece], Pass]] = {}  # bucket -> its pieces and their pass's state
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(model.device) if capture else None  # warm-ups and captures run on it
        self.signal = HostSignal(model.device) if capture else None  # a host step's results are ready
        # host time of the replayed steps (capture steps are left out): whole steps, CPU experts, GPU waits; and of
        # the host steps after a step's first (a MoE layer after another): their experts, and the hand-offs before
        # them (from the previous host step's end, its signal given, to their start: the GPU's work between two
        # layers' CPU experts, and the launches meanwhile)
        self.seconds = {"steps": 0.0, "experts": 0.0, "wait": 0.0, "later experts": 0.0, "hand-offs": 0.0}
        self.steps = 0  # replayed steps
        self.later_layers = 0  # host steps after a step's first, in the replayed steps

    def bucket(self, end: int) -> int:
        return min(max(self.min_bucket, 1 << (end - 1).bit_length()), self.cache.max_seq_len)

    def _pass(self, bucket: int) -> Pass:
        return Pass(self.token, self.positions, bucket, self.cache)

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Append token at position cache.length; its logits [vocab] (fp32; valid until the next step)."""
        t0 = time.perf_counter()
        cache = self.cache
        position = cache.length
        cache.begin_pass(1)
        self.token.fill_(token)
        self.positions.fill_(position)
        bucket = self.bucket(position + 1)
        replayed = bucket in self.buckets
        if not replayed:
            self.buckets[bucket] = self._record(bucket)
        split = self._replay(*self.buckets[bucket])
        cache.length = position + 1
        if replayed:
            self.seconds["steps"] += time.perf_counter() - t0
            for name, seconds in split.items():
                self.seconds[name] += seconds
            self.steps += 1
            self.later_layers += max(0, sum(p.host is not None for p in self.buckets[bucket][0]) - 1)
        return self.buckets[bucket][1].logits[0]

    def _record(self, bucket: int) -> tuple[list[Piece], Pass]:
        """The bucket's pieces and the state they read and write: captured as graphs (after one eager pass), or
        without capture the steps to run."""
        steps = self.model.steps()
        if not self.capture:
            return pieces(steps), self._pass(bucket)
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        # the warm-up runs the step once: rows are rewritten as they were, but KDA states would advance twice
        kept = [(t, t.clone()) for t in self.cache.states().values()]
        with torch.cuda.stream(self.stream):  # the warm-up: kernels compiled, workspaces allocated
            run_steps(steps, self._pass(bucket))
            self.signal.give()
            self.signal.wait()  # (its kernel too, given its signal)
            for t, before in kept:
                t.copy_(before)
        main.wait_stream(self.stream)
        s, cut = self._pass(bucket), pieces(steps)
        for piece in cut:  # in order, so later pieces read the earlier ones' static outputs
            if piece.steps:
                piece.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(piece.graph, pool=self.pool, stream=self.stream):
                    if piece.after_host:
                        self.signal.wait()
                    for step in piece.steps:
                        step(s)
                    if piece.cut:  # (a cut piece without steps adds no work to wait for)
                        piece.done = torch.cuda.Event(external=True)
                        piece.done.record()
        return cut, s

    def _replay(self, cut: list[Piece], s: Pass) -> dict[str, float]:
        """One step: each piece in turn, the host's work after its piece once the last cut's work is done; with
        graphs the piece after a host step is replayed before that work, and waits on the GPU for its signal."""
        try:
            return self._replay_pieces(cut, s)
        except BaseException:
            if self.capture:  # a wait may be queued for a signal that will not come
                self.signal.release()
            raise

    def _replay_pieces(self, cut: list[Piece], s: Pass) -> dict[str, float]:
        split = {"experts": 0.0, "wait": 0.0, "later experts": 0.0, "hand-offs": 0.0}
        ready = handed = None  # handed: when the last host step ended
        for i, piece in enumerate(cut):
            if piece.graph is not None and not piece.after_host:
                piece.graph.replay()
            elif not self.capture:
                run_steps(piece.steps, s)
            if piece.done is not None:
                ready = piece.done
            if piece.host is not None:
                ahead = cut[i + 1] if self.capture and i + 1 < len(cut) else None  # starts with the signal's wait
                if ahead is not None:
                    ahead.graph.replay()  # (every piece after a host step has GPU steps: its sum's combine)
                t0 = time.perf_counter()
                if ready is not None:
                    ready.synchronize()
                t1 = time.perf_counter()
                piece.host(s)
                t2 = time.perf_counter()
                if ahead is not None:  # one signal a wait queued: the counts stay aligned
                    self.signal.give()
                split["wait"] += t1 - t0
                split["experts"] += t2 - t1
                if handed is not None:
                    split["hand-offs"] += t1 - handed
                    split["later experts"] += t2 - t1
                handed = time.perf_counter()
        return split
