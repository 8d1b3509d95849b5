"""Decode from CUDA graphs: one token a step, the GPU's work replayed in a few launches per MoE layer.

In eager mode a GLM-5 layer issues some 200 kernels, and Python's cost of launching them is many times the
GPU's work; with the routed experts on the CPU the step is then Python + GPU + CPU experts, one after the
other. Here each step's GPU work is cut at the CPU experts into captured pieces. For a MoE layer i:

    A_i  the previous layer's expert sum (H2D from a pinned buffer) + its shared expert + residual, norm,
         attention (indexer, top-k, tiered fetch, sparse MLA), residual, norm, router, and the router's
         input, choice and weights copied D2H into pinned buffers
    B_i  the shared expert, which the GPU runs while the CPU runs the routed experts

The host replays A_i and B_i, waits for A_i alone (the one synchronisation of the layer), runs the routed
experts on every core into a pinned buffer, and replays A_{i+1}. Dense layers join the piece they sit in;
the final norm and lm_head are the last piece.

Nothing in a piece depends on a host-side position: the token and its position live in device tensors,
and keys and rows are read up to a bucket bound (a power of two >= the context), masked past the position.
One set of graphs serves every position of its bucket; a new bucket is captured at its first step (a warm-up
run, the capture, then the replay, so that step's cache writes and LRU updates happen twice, harmlessly).
With capture=False the same pieces run eagerly: the CPU tests check the cut against the model's forward.
"""

import time
from dataclasses import dataclass

import torch

from .experts_numba import NumbaExperts
from .kv_cache import KVCache
from .model import CausalLM, MoE
from .rope import cos_sin

MIN_BUCKET = 4096  # smallest key bound: below it, reading more keys costs less than more graphs


def unsupported(model: CausalLM) -> str | None:
    """Why this placement cannot decode from CUDA graphs (None: it can)."""
    if model.device.type != "cuda":
        return "the model's residual stream is not on a GPU"
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE) and not isinstance(layer.mlp.experts, NumbaExperts):
            return f"layer {i}'s routed experts are not experts.numba (only CPU experts are cut out of the graphs)"
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != model.device:  # a copy between devices inside a piece would need the host
            return f"{name} is on {t.device}, not on the residual stream's {model.device}"
    return None


@dataclass
class Piece:
    steps: list  # functions of the bucket's state dict, run (or captured) in order
    experts: NumbaExperts | None = None  # after queueing the piece: wait for what came before it, run these
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: KVCache, capture: bool = True, min_bucket: int = MIN_BUCKET):
        self.model, self.cache, self.capture, self.min_bucket = model, cache, capture, min_bucket
        device, config = model.device, model.config
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.inv_freq = model.inv_freq.to(device)
        pin = device.type == "cuda"
        k = config.num_experts_per_tok
        self.x_host = torch.zeros(1, config.hidden_size, dtype=torch.float32, pin_memory=pin)
        self.ids_host = torch.zeros(1, k, dtype=torch.long, pin_memory=pin)
        self.w_host = torch.zeros(1, k, dtype=torch.float32, pin_memory=pin)
        self.out_host = torch.zeros(1, config.hidden_size, dtype=torch.float32, pin_memory=pin)
        self.out_device = torch.zeros(1, config.hidden_size, dtype=torch.float32, device=device)
        self.buckets: dict[int, tuple[list[Piece], dict]] = {}  # bucket -> its pieces and their state
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device) if capture else None  # warm-ups and captures run on it
        # host time of the replayed steps (capture steps are left out): whole steps, CPU experts, GPU waits
        self.seconds = {"steps": 0.0, "experts": 0.0, "wait": 0.0}
        self.steps = 0  # replayed steps
        self._step_seconds = {"experts": 0.0, "wait": 0.0}

    def bucket(self, end: int) -> int:
        return min(max(self.min_bucket, 1 << (end - 1).bit_length()), self.cache.max_seq_len)

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
        self._step_seconds = {"experts": 0.0, "wait": 0.0}
        replayed = bucket in self.buckets
        if replayed:
            pieces, state = self.buckets[bucket]
            for piece in pieces:
                self._run(piece, state, replay=True)
        else:
            pieces, state = self._pieces(bucket), {}
            for piece in pieces:
                self._run(piece, state, replay=False)
            self.buckets[bucket] = pieces, state
        cache.length = position + 1
        if replayed:
            self.seconds["steps"] += time.perf_counter() - t0
            for name, seconds in self._step_seconds.items():
                self.seconds[name] += seconds
            self.steps += 1
        return state["logits"][0]

    def _run(self, piece: Piece, state: dict, replay: bool):
        ready = None
        if piece.experts is not None and self.capture:
            ready = torch.cuda.Event()
            ready.record()
        if replay and piece.graph is not None:
            piece.graph.replay()
        elif piece.steps and not self.capture:
            for fn in piece.steps:
                fn(state)
        elif piece.steps:
            main = torch.cuda.current_stream()
            inputs = dict(state)
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):  # the warm-up: kernels compiled, workspaces allocated
                for fn in piece.steps:
                    fn(state)
            main.wait_stream(self.stream)
            state.clear()
            state.update(inputs)  # the capture reads the previous pieces' static outputs, not the warm-up's
            piece.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(piece.graph, pool=self.pool, stream=self.stream):
                for fn in piece.steps:
                    fn(state)
            piece.graph.replay()
        if piece.experts is not None:
            t0 = time.perf_counter()
            if ready is not None:
                ready.synchronize()
            t1 = time.perf_counter()
            piece.experts.compute_host(self.x_host, self.ids_host, self.w_host, self.out_host)
            self._step_seconds["wait"] += t1 - t0
            self._step_seconds["experts"] += time.perf_counter() - t1

    def _pieces(self, bucket: int) -> list[Piece]:
        """The step's GPU work cut at each layer's CPU experts."""
        model, cache = self.model, self.cache

        def embed(s):
            s["x"] = model.model.embed_tokens(self.token)
            s["cos"], s["sin"] = cos_sin(self.inv_freq, model.rope_scaling, self.positions)
            s["indices"] = None

        def attention(layer):
            def run(s):
                h, s["indices"] = layer.self_attn(layer.input_layernorm(s["x"]), s["cos"], s["sin"], cache,
                                                  self.positions, bucket, s["indices"])
                s["x"] = s["x"] + h
            return run

        def mlp(layer):
            def run(s):
                s["x"] = s["x"] + layer.mlp(layer.post_attention_layernorm(s["x"]))
            return run

        def route(layer):
            def run(s):
                s["y"] = y = layer.post_attention_layernorm(s["x"])
                ids, weights = layer.mlp.gate(y)
                for host, t in ((self.x_host, y.float()), (self.ids_host, ids), (self.w_host, weights)):
                    host.copy_(t, non_blocking=True)
            return run

        def shared(layer):
            def run(s):
                s["shared"] = layer.mlp.shared_experts(s["y"])
            return run

        def take_experts(has_shared):
            def run(s):
                self.out_device.copy_(self.out_host, non_blocking=True)
                moe = self.out_device.to(s["x"].dtype)
                s["x"] = s["x"] + (moe + s["shared"] if has_shared else moe)
            return run

        def head(s):
            s["logits"] = model.lm_head(model.model.norm(s["x"])).float()

        pieces, steps = [], [embed]
        for layer in model.model.layers:
            steps.append(attention(layer))
            if not isinstance(layer.mlp, MoE):
                steps.append(mlp(layer))
                continue
            has_shared = layer.mlp.shared_experts is not None
            steps.append(route(layer))
            pieces.append(Piece(steps))
            pieces.append(Piece([shared(layer)] if has_shared else [], experts=layer.mlp.experts))
            steps = [take_experts(has_shared)]
        pieces.append(Piece(steps + [head]))
        return pieces
