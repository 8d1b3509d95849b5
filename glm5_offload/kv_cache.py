"""The latent KV cache of one sequence: 576 values per token per layer, never expanded K/V.

Per layer: latent rows [max_seq_len, kv_lora_rank + qk_rope_head_dim] = [normed c | roped k_pe], in the
model's dtype, or in the FP8 form (656 B for GLM-5): [c as e4m3 | one fp32 scale per 128 values of c |
k_pe as bf16], as uint8 bytes. A layer's rows live on its attention's device, or (offload) in pinned host
memory with a hot buffer on the device (tiered_kv.py).
Per full (indexer-owning) layer: indexer keys [max_seq_len, index_head_dim] on the indexer's device, in the
model's dtype, or with an FP8 layout as e4m3 values plus one fp32 scale per key (132 B for GLM-5).
Shared layers keep none.
"""

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import Glm5Error
from .kernels.dsa_triton import FP8_MAX, fp8_latent_group
from .operators import is_positive_int
from .tiered_kv import TieredLatent


@dataclass(frozen=True)
class FP8Keys:
    """A full layer's indexer keys in the FP8 form: e4m3 values [max_seq_len, D] and fp32 scales [max_seq_len]."""

    values: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class LatentLayout:
    """How one layer keeps its latent rows (from the attention rule's kwargs)."""

    fp8: bool = False  # latent rows in the 656 B form, and the layer's indexer keys in the 132 B one
    offload: bool = False  # rows in host memory, a hot buffer on the attention's device
    hot_bytes: int = 256 << 20  # with offload: the hot buffer's budget
    window: int = 1024  # with offload: recent tokens always hot


LAYOUT_KWARGS = ("kv_dtype", "kv_offload", "hot_budget", "window")


def latent_layout(kwargs: dict, kv_dtype: str | None = None) -> LatentLayout:
    """An attention rule's kwargs -> the layer's LatentLayout; kv_dtype (the --kv-dtype flag) overrides theirs.
    Raises Glm5Error naming the kwarg at fault."""
    from .planner import parse_size

    kv_dtype = kv_dtype or kwargs.get("kv_dtype", "auto")
    if kv_dtype not in ("auto", "fp8"):
        raise Glm5Error(f"kv_dtype must be 'auto' (the model's dtype) or 'fp8', got {kv_dtype!r}")
    offload = kwargs.get("kv_offload", False)
    if not isinstance(offload, bool):
        raise Glm5Error(f"kv_offload must be true or false, got {offload!r}")
    hot = kwargs.get("hot_budget", "256MiB")
    hot_bytes = parse_size(str(hot), "hot_budget")
    window = kwargs.get("window", 1024)
    if not is_positive_int(window):
        raise Glm5Error(f"window must be a positive number of tokens, got {window!r}")
    return LatentLayout(fp8=kv_dtype == "fp8", offload=offload, hot_bytes=hot_bytes, window=window)


def fp8_row_width(kv_lora_rank: int, rope_dim: int) -> int:
    return kv_lora_rank + kv_lora_rank // fp8_latent_group(kv_lora_rank) * 4 + rope_dim * 2


def quantize_latent(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Latent rows [N, L+R] -> their FP8 form [N, L + 4L/128 + 2R] uint8."""
    N, L = rows.shape[0], kv_lora_rank
    G = fp8_latent_group(L)
    c = rows[:, :L].float().view(N, L // G, G)
    scale = c.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [N, L/G]
    c8 = (c / scale[..., None]).to(torch.float8_e4m3fn).view(N, L)
    pe = rows[:, L:].to(torch.bfloat16)
    return torch.cat([c8.view(torch.uint8), scale.view(torch.uint8), pe.view(torch.uint8)], dim=1)


def dequantize_latent(packed: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """FP8 rows [N, L + 4L/G + 2R] uint8 -> fp32 [N, L+R]."""
    N, L = packed.shape[0], kv_lora_rank
    G = fp8_latent_group(L)
    c8 = packed[:, :L].contiguous().view(torch.float8_e4m3fn).float().view(N, L // G, G)
    scale = packed[:, L : L + 4 * (L // G)].contiguous().view(torch.float32)
    pe = packed[:, L + 4 * (L // G) :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(c8 * scale[..., None]).view(N, L), pe], dim=1)


class KVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, latent_devices: list, index_devices: dict,
                 dtype: torch.dtype, layouts: list[LatentLayout] | None = None):
        """latent_devices: one device per layer; index_devices: full layer -> device of its indexer keys."""
        self.max_seq_len, self.kv_lora_rank = max_seq_len, config.kv_lora_rank
        self.layouts = layouts or [LatentLayout()] * len(latent_devices)
        self.latent: list[torch.Tensor | TieredLatent] = []
        staging_rows = {}  # device -> width of the prefill staging buffer the offloaded layers share
        for device, layout in zip(latent_devices, self.layouts):
            device = torch.device(device)
            width = fp8_row_width(config.kv_lora_rank, config.qk_rope_head_dim) if layout.fp8 else config.latent_dim
            row_dtype = torch.uint8 if layout.fp8 else dtype
            if layout.offload:
                hot_rows = layout.hot_bytes // (width * row_dtype.itemsize)
                if hot_rows < layout.window + 2 * config.index_topk:
                    raise Glm5Error(f"hot_budget {layout.hot_bytes} B holds {hot_rows} latent rows of "
                                    f"{width * row_dtype.itemsize} B: it needs at least window {layout.window} "
                                    f"+ 2 x index_topk {config.index_topk}")
                self.latent.append(TieredLatent(max_seq_len, width, row_dtype, device, hot_rows, layout.window))
                staging_rows[device, row_dtype] = max(width, staging_rows.get((device, row_dtype), 0))
            else:
                self.latent.append(torch.empty(max_seq_len, width, device=device, dtype=row_dtype))
        self.staging = {key: torch.empty(max_seq_len, width, dtype=key[1], device=key[0])
                        for key, width in staging_rows.items()}
        self.index_keys: dict[int, torch.Tensor | FP8Keys] = {}
        for i, d in index_devices.items():
            if self.layouts[i].fp8:
                self.index_keys[i] = FP8Keys(
                    torch.empty(max_seq_len, config.index_head_dim, device=d, dtype=torch.float8_e4m3fn),
                    torch.empty(max_seq_len, device=d, dtype=torch.float32))
            else:
                self.index_keys[i] = torch.empty(max_seq_len, config.index_head_dim, device=d, dtype=dtype)
        self.prefetched: dict[int, torch.cuda.Event | None] = {}  # offloaded layer -> its pending prefetch
        self.side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.length = 0  # tokens whose rows are written in every layer

    def begin_pass(self, n_new: int):
        """Before a forward of n_new tokens at positions length..: refuse what would not fit, and reset the hot
        state of offloaded layers whose rows were rewound (a chat's next turn keeping a common prefix)."""
        if self.length + n_new > self.max_seq_len:
            raise Glm5Error(
                f"context of {self.length + n_new} tokens exceeds max_seq_len {self.max_seq_len}"
            )
        for rows_store in self.latent:
            if isinstance(rows_store, TieredLatent):
                if rows_store.end != self.length:
                    rows_store.reset(self.length)
                rows_store.end = self.length + n_new

    def write_latent(self, layer: int, positions: torch.Tensor, rows: torch.Tensor):
        """rows [S, L+R] (compute dtype) of the tokens at positions [S] into layer's cache, in its form."""
        if self.layouts[layer].fp8:
            rows = quantize_latent(rows, self.kv_lora_rank)
        rows_store = self.latent[layer]
        if isinstance(rows_store, TieredLatent):
            self._wait_prefetch(layer)
            rows_store.write(positions, rows)
        else:
            rows_store.index_copy_(0, positions, rows.to(rows_store.dtype))

    def rows_for(self, layer: int, indices: torch.Tensor, positions: torch.Tensor, end: int):
        """The latent rows attention reads for the queries at positions [S] (all below end) and their indices
        [S, K] into them."""
        rows_store = self.latent[layer]
        if not isinstance(rows_store, TieredLatent):
            return rows_store[:end], indices
        if rows_store.fits_fetch(indices):  # decode: rows from the hot buffer, misses fetched into it
            if layer in self.prefetched:
                del self.prefetched[layer]
            else:
                rows_store.fetch(indices, positions[0], positions[-1] + 1 - rows_store.window)
            return rows_store.hot, rows_store.slot_of[indices]
        staging = self.staging[rows_store.device, rows_store.host.dtype]  # prefill: every row so far, one copy
        staging[:end].copy_(rows_store.host[:end], non_blocking=True)
        return staging[:end], indices

    def prefetch(self, layers: list[int], indices: torch.Tensor, positions: torch.Tensor):
        """IndexShare: shared layers reuse a full layer's indices, so their misses can be fetched now, on a side
        stream (CUDA), overlapped with the layers in between."""
        below, window_end = positions[0], positions[-1] + 1
        for layer in layers:
            rows_store = self.latent[layer]
            if not isinstance(rows_store, TieredLatent) or not rows_store.fits_fetch(indices):
                continue
            if rows_store.device.type != "cuda":
                rows_store.fetch(indices, below, window_end - rows_store.window)
                self.prefetched[layer] = None
                continue
            if rows_store.device not in self.side_streams:
                self.side_streams[rows_store.device] = torch.cuda.Stream(rows_store.device)
            side = self.side_streams[rows_store.device]
            side.wait_stream(torch.cuda.current_stream(rows_store.device))
            with torch.cuda.stream(side):
                rows_store.fetch(indices, below, window_end - rows_store.window)
                indices.record_stream(side)
                positions.record_stream(side)
                self.prefetched[layer] = side.record_event()

    def _wait_prefetch(self, layer: int):
        event = self.prefetched.get(layer)
        if event is not None:  # the layer's fetch must finish before its window moves
            torch.cuda.current_stream(self.latent[layer].device).wait_event(event)

    def offload_stats(self) -> dict:
        """Over offloaded layers: selected rows found hot, rows fetched from the host, bytes fetched."""
        tiers = [t for t in self.latent if isinstance(t, TieredLatent)]
        hits = sum(int(t.hits) for t in tiers)
        misses = sum(int(t.misses) for t in tiers)
        return {"hits": hits, "misses": misses, "fetched_bytes": sum(int(t.misses) * t.row_bytes() for t in tiers)}

    def nbytes(self) -> int:
        """Bytes on the devices the cache lives on (offloaded layers: their host rows and hot buffers)."""
        total = 0
        for rows_store in self.latent:
            if isinstance(rows_store, TieredLatent):
                total += rows_store.host.numel() * rows_store.host.element_size() + rows_store.nbytes_hot()
            else:
                total += rows_store.numel() * rows_store.element_size()
        total += sum(t.numel() * t.element_size() for t in self.staging.values())
        for keys in self.index_keys.values():
            for t in (keys.values, keys.scales) if isinstance(keys, FP8Keys) else (keys,):
                total += t.numel() * t.element_size()
        return total
