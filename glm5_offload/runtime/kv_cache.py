"""The KV cache of one sequence: per DSA layer its latent rows, per full (indexer-owning) layer its indexer keys, in
the forms of formats/kv_rows.py, where each layer's LatentLayout (set by its attention operator) puts them; per KDA
layer (GLM-5.3-Flash) its recurrent state.

A layer's latent rows live on its attention's device, or (offload) in pinned host memory with a hot buffer on the
device (tiered_kv.py). Indexer keys live on the indexer's device, as a tensor in the model's dtype, as FP8Keys, or
(GLM-5.3-Flash's pooled indexer) as PooledKeys. Shared layers keep none.

Rows can be rewound (a chat's next turn keeps the common prefix); a KDA state cannot. A cache with KDA layers keeps
one resume point besides its end: the state after a prompt's last-but-one token (Engine.generate marks it), from
which the next prompt that repeats the last one resumes.
"""

import torch

from ..config import ModelConfig
from ..errors import Glm5Error
from ..formats.kv_rows import FP8Keys, fp8_row_width, quantize_latent
from ..kernels import dsa_triton
from ..model import KDA, CausalLM, KDAState, LatentLayout, PooledKeys
from ..util import Beside
from .tiered_kv import TieredLatent


def new_cache(model: CausalLM, max_seq_len: int) -> "KVCache":
    """An empty cache for max_seq_len tokens laid out as the model's attention operators say."""
    attention = [layer.self_attn for layer in model.model.layers]
    return KVCache(model.config, max_seq_len, [None if isinstance(a, KDA) else a.latent_layout for a in attention],
                   model.dtype, {a.layer: a.A_log.device for a in attention if isinstance(a, KDA)})


class KVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, layouts: list[LatentLayout | None], dtype: torch.dtype,
                 kda_devices: dict[int, torch.device] | None = None):
        """layouts: one per layer (None for a KDA layer); dtype: the model's (latent rows and indexer keys not in FP8
        are kept in it); kda_devices: each KDA layer's state's device."""
        self.max_seq_len, self.kv_lora_rank, self.layouts = max_seq_len, config.kv_lora_rank, layouts
        self.latent: list[torch.Tensor | TieredLatent | None] = []
        staging_rows = {}  # (device, row dtype) -> (width, rows) of the prefill staging buffer offloaded layers share
        for layout in layouts:
            if layout is None:
                self.latent.append(None)
                continue
            device = layout.device
            width = fp8_row_width(config.kv_lora_rank, config.qk_rope_head_dim) if layout.fp8 else config.latent_dim
            row_dtype = torch.uint8 if layout.fp8 else dtype
            if layout.offload:
                hot_rows = layout.hot_rows(width * row_dtype.itemsize)
                if hot_rows < layout.window + 2 * config.index_topk:
                    raise Glm5Error(f"hot_budget {layout.hot_bytes} B holds {hot_rows} latent rows of "
                                    f"{width * row_dtype.itemsize} B: it needs at least window {layout.window} "
                                    f"+ 2 x index_topk {config.index_topk}")
                self.latent.append(TieredLatent(max_seq_len, width, row_dtype, device, hot_rows, layout.window))
                staging_rows[device, row_dtype] = max((width, layout.prefill_rows),
                                                      staging_rows.get((device, row_dtype), (0, 0)))
            else:
                self.latent.append(torch.empty(max_seq_len, width, device=device, dtype=row_dtype))
        self.staging = {key: torch.empty(min(max_seq_len, rows), width, dtype=key[1], device=key[0])
                        for key, (width, rows) in staging_rows.items()}
        self.index_keys: dict[int, torch.Tensor | FP8Keys] = {}
        for i, layout in enumerate(layouts):
            d = None if layout is None else layout.index_device
            if d is None:
                continue
            if config.model_type == "glm5_next":  # one key per group of index_kpool tokens: kept in the model's dtype
                self.index_keys[i] = PooledKeys.empty(config, max_seq_len, d, dtype)
            elif layout.fp8:
                self.index_keys[i] = FP8Keys(
                    torch.empty(max_seq_len, config.index_head_dim, device=d, dtype=torch.float8_e4m3fn),
                    torch.empty(max_seq_len, device=d, dtype=torch.float32))
            else:
                self.index_keys[i] = torch.empty(max_seq_len, config.index_head_dim, device=d, dtype=dtype)
        # offloaded layer -> its pending prefetch: (the event to wait for or None, the slots its fetch returned)
        self.prefetched: dict[int, tuple[torch.cuda.Event | None, torch.Tensor]] = {}
        self.sorted_indices: tuple[torch.Tensor, torch.Tensor] | None = None  # (indices, sorted): row_slabs' last
        self.kda = {i: KDAState(config, device, dtype) for i, device in (kda_devices or {}).items()}
        self.resume_point: tuple[int, dict[str, torch.Tensor]] | None = None  # (length, copies of the states)
        self.length = 0  # tokens whose rows are written in every layer

    def states(self) -> dict[str, torch.Tensor]:
        """The fixed-size state a length of rows does not say: KDA states, the pooled indexers' current groups."""
        states = {f"kda.{i}.{name}": t for i, kda in self.kda.items() for name, t in kda.tensors().items()}
        for i, keys in self.index_keys.items():
            if isinstance(keys, PooledKeys):
                states[f"tail_keys.{i}"], states[f"tail_gates.{i}"] = keys.tail_keys, keys.tail_gates
        return states

    def saved_tensors(self, n: int) -> dict[str, torch.Tensor]:
        """What a saved context holds of the first n tokens (n = length when saving), by name: each layer's latent
        rows (a tiered layer's host rows) and indexer keys in their stored form, and the fixed-size states."""
        tensors = {}
        for i, rows in enumerate(self.latent):
            if rows is not None:
                tensors[f"latent.{i}"] = (rows.host if isinstance(rows, TieredLatent) else rows)[:n]
        for i, keys in self.index_keys.items():
            if isinstance(keys, FP8Keys):
                tensors[f"keys.{i}"], tensors[f"key_scales.{i}"] = keys.values[:n], keys.scales[:n]
            elif isinstance(keys, PooledKeys):
                tensors[f"keys.{i}"] = keys.groups[: -(-n // keys.tail_keys.shape[0])]
            else:
                tensors[f"keys.{i}"] = keys[:n]
        return {**tensors, **self.states()}

    def replaced(self, n: int):
        """After the rows and states of n tokens were written in from elsewhere (a saved context): the length n, no
        resume point, and no row of what the tiered layers held before left hot."""
        self.length, self.resume_point = n, None
        for rows_store in self.latent:
            if isinstance(rows_store, TieredLatent):
                rows_store.forget(n)

    def mark_resume_point(self):
        """Keep the state at the current length: a later rewind to it (or past it) resumes there."""
        if self.kda:
            self.resume_point = self.length, {name: t.clone() for name, t in self.states().items()}

    def rewind(self, keep: int) -> int:
        """Keep at most the first `keep` tokens: rows rewind anywhere; with KDA layers only to the end, the resume
        point or 0 (states cleared). The tokens kept."""
        if self.kda and keep < self.length:
            keep = self._states_back_to(keep)
        self.length = min(keep, self.length)
        if self.resume_point is not None and self.resume_point[0] > self.length:
            self.resume_point = None  # its rows will be overwritten
        return self.length

    def _states_back_to(self, keep: int) -> int:
        """The states as at the resume point where it is at or before keep, else cleared; the tokens they hold."""
        point = self.resume_point
        if point is not None and point[0] <= keep:
            for name, t in self.states().items():
                t.copy_(point[1][name])
            return point[0]
        for t in self.states().values():
            t.zero_()
        return 0

    def abandon_pass(self):
        """After a pass that did not finish (Ctrl-C, the GPU out of memory): its rows lie past length, written again
        by the next pass, but the KDA states took part of it in place: they go back to the resume point, or to
        empty."""
        if self.kda:
            self.length = self._states_back_to(self.length)

    def begin_pass(self, n_new: int):
        """Before a forward of n_new tokens at positions length..: refuse what would not fit, and reset the hot
        state of offloaded layers whose rows were rewound (a chat's next turn keeping a common prefix)."""
        if self.length + n_new > self.max_seq_len:
            raise Glm5Error(
                f"context of {self.length + n_new} tokens exceeds max_seq_len {self.max_seq_len}"
            )
        self.sorted_indices = None  # the last pass's (a long chunk's: held no longer)
        for rows_store in self.latent:
            if isinstance(rows_store, TieredLatent):  # (None: a KDA layer)
                if rows_store.end != self.length:
                    rows_store.reset(self.length)
                rows_store.end = self.length + n_new

    def write_latent(self, layer: int, positions: torch.Tensor, rows: torch.Tensor):
        """rows [S, L+R] (compute dtype) of the tokens at positions [S] into layer's cache, in its form (FP8 on a
        GPU: by one Triton kernel, the same bytes as the reference's ten; rows already in the FP8 form (uint8) are
        written as they are)."""
        if self.layouts[layer].fp8 and rows.dtype != torch.uint8:
            rows = (dsa_triton.quantize_latent if rows.is_cuda else quantize_latent)(rows, self.kv_lora_rank)
        rows_store = self.latent[layer]
        if isinstance(rows_store, TieredLatent):
            self._wait_prefetch(layer)
            rows_store.write(positions, rows)
        else:
            rows_store.index_copy_(0, positions, rows.to(rows_store.dtype))

    def row_slabs(self, layer: int, indices: torch.Tensor, positions: torch.Tensor, end: int):
        """The latent rows attention reads for the queries at positions [S] (all below end), in key slabs whose
        attentions are merged by log-sum-exp: (rows, indices [S, K] into them (-1 = none), None or the span [S, 2]
        int32 of each row that holds its valid indices).

        One slab, the layer's own rows, unless the layer is offloaded: decode reads the hot buffer (misses fetched
        into it); a prefill chunk reads its rows through the staging buffer, which holds prefill_rows rows: every
        row so far in one copy while they fit, else slabs of that many consecutive positions copied in turn from
        host memory (at the copy engine's speed, whatever the queries selected), the indices sorted so that each
        slab's lie in one run."""
        rows_store = self.latent[layer]
        if not isinstance(rows_store, TieredLatent):
            yield rows_store[:end], indices, None
            return
        if rows_store.fits_fetch(indices):  # decode: rows from the hot buffer, misses fetched into it
            if layer in self.prefetched:  # its fetch's slots (the main stream waited for it in write_latent)
                yield rows_store.hot, self.prefetched.pop(layer)[1], None
            else:
                yield rows_store.hot, rows_store.fetch(indices, positions), None
            return
        staging = self.staging[rows_store.device, rows_store.host.dtype]
        if end <= staging.shape[0]:
            staging[:end].copy_(rows_store.host[:end], non_blocking=True)
            yield staging[:end], indices, None
            return
        ordered = self._sorted(indices)
        for first in range(0, end, staging.shape[0]):
            n = min(staging.shape[0], end - first)
            staging[:n].copy_(rows_store.host[first : first + n], non_blocking=True)  # after the last slab's reads
            bounds = torch.tensor([[first, first + n]], device=ordered.device).expand(ordered.shape[0], 2)
            span = torch.searchsorted(ordered, bounds.contiguous()).to(torch.int32)
            yield staging[:n], torch.where((ordered >= first) & (ordered < first + n), ordered - first, -1), span

    def _sorted(self, indices: torch.Tensor) -> torch.Tensor:
        """indices sorted along each row; the last one kept, since IndexShare's shared layers pass the same tensor."""
        if self.sorted_indices is None or self.sorted_indices[0] is not indices:
            self.sorted_indices = (indices, indices.sort(dim=1).values)
        return self.sorted_indices[1]

    def prefetch(self, layers: list[int], indices: torch.Tensor, positions: torch.Tensor):
        """IndexShare: shared layers reuse a full layer's indices, so their misses can be fetched now, on a side
        stream (CUDA), overlapped with the work queued after it: until join_prefetch while a CUDA graph is captured
        (decode: the shared expert and the GPU's experts), else until the layer's write (the layers in between)."""
        for layer in layers:
            rows_store = self.latent[layer]
            if not isinstance(rows_store, TieredLatent) or not rows_store.fits_fetch(indices):
                continue
            with Beside(rows_store.device) as beside:
                slots = rows_store.fetch(indices, positions)
            event = None
            if beside.side is not None:  # waited for by join_prefetch or the layer's write (_wait_prefetch)
                if not torch.cuda.is_current_stream_capturing():  # (a graph's tensors stay put in its pool)
                    indices.record_stream(beside.side)
                    positions.record_stream(beside.side)
                event = beside.side.record_event()
            self.prefetched[layer] = (event, slots)  # the slots attention reads once the layer's row is written

    def join_prefetch(self):
        """While a CUDA graph is captured, the current stream waits here for the pending prefetches (a capture must
        end with its side streams joined); eagerly nothing: each shared layer waits at its write."""
        for layer, (event, slots) in self.prefetched.items():
            if event is not None and torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream(self.latent[layer].device).wait_event(event)
                self.prefetched[layer] = (None, slots)

    def _wait_prefetch(self, layer: int):
        event = self.prefetched.get(layer, (None,))[0]
        if event is not None:  # the layer's fetch must finish before its window moves
            torch.cuda.current_stream(self.latent[layer].device).wait_event(event)

    def offload_stats(self) -> dict:
        """Over offloaded layers: selected rows found hot, rows fetched from the host, bytes fetched."""
        tiers = [t for t in self.latent if isinstance(t, TieredLatent)]
        hits = sum(int(t.hits) for t in tiers)
        misses = sum(int(t.misses) for t in tiers)
        return {"hits": hits, "misses": misses, "fetched_bytes": sum(int(t.misses) * t.row_bytes() for t in tiers)}
