"""The reference operators: the plain-torch modules of glm5_offload.model themselves, weights in the compute dtype.

Attention and experts operators know more than weights: an attention operator keeps its layer's cache (the form and
place of its latent rows and indexer keys, from the rule's kwargs: shared with attention.dsa_triton), and an experts
operator's format decides its bytes and what a decode token reads of it (shared with experts.numba).
"""

import torch
from torch import nn

from ..errors import Glm5Error
from ..formats import dtype_name
from ..formats.int_groups import BITS, GROUP, describe, nbytes
from ..formats.kv_rows import fp8_row_width, key_bytes, latent_row_bytes
from ..model import (
    KDA,
    MLP,
    SCORE_BUDGET,
    Attention,
    Experts,
    HyperConnection,
    Indexer,
    LatentLayout,
    Linear,
    LMHead,
    PooledIndexer,
    RMSNorm,
    Router,
)
from ..model.kda import CHUNK
from ..util import human_bytes, is_positive_int, parse_size
from .base import Buffer, BuildContext, Operator, PlanContext, Slot

TEMPORARY_BYTES = 4  # temporaries are fp32 at worst
SLOT_BYTES = 4  # a tiered layer's hot-slot table entry per token, on the device (runtime/tiered_kv.py's slot_of)
LRU_SLOT_BYTES = 20  # its token_of and stamp entries (int64) and victims queue entry (int32) per LRU slot
LAYOUT_KWARGS = ("kv_dtype", "kv_offload", "hot_budget", "window", "prefill_rows")


class AttentionOperator(Operator):
    """Attention over the layer's cache; its kwargs say how the layer keeps that cache:
    kv_dtype (auto: the model's dtype, or fp8: 656 B latent rows and 132 B indexer keys), kv_offload (every row in
    pinned host memory, a hot buffer of hot_budget bytes on the attention's device, the last `window` tokens hot, a
    prefill chunk's rows read through a staging buffer of prefill_rows rows)."""

    def parse_kwargs(self, kwargs: dict) -> dict:
        kv_dtype = kwargs.get("kv_dtype", "auto")
        if kv_dtype not in ("auto", "fp8"):
            raise Glm5Error(f"kv_dtype must be 'auto' (the model's dtype) or 'fp8', got {kv_dtype!r}")
        offload = kwargs.get("kv_offload", False)
        if not isinstance(offload, bool):
            raise Glm5Error(f"kv_offload must be true or false, got {offload!r}")
        hot = kwargs.get("hot_budget", "256MiB")
        window = kwargs.get("window", 1024)
        if not is_positive_int(window):
            raise Glm5Error(f"window must be a positive number of tokens, got {window!r}")
        prefill_rows = kwargs.get("prefill_rows", 1 << 18)
        if not is_positive_int(prefill_rows):
            raise Glm5Error(f"prefill_rows must be a positive number of rows, got {prefill_rows!r}")
        return {"kv_dtype": kv_dtype, "kv_offload": offload, "hot_budget": parse_size(str(hot), "hot_budget"),
                "window": window, "prefill_rows": prefill_rows}

    def layout(self, slot: Slot, kv_dtype: str | None = None) -> LatentLayout:
        """The layer's LatentLayout; kv_dtype "fp8" (the --kv-dtype flag) puts it in the FP8 forms whatever the rule."""
        indexer = slot.children.get("indexer")
        k = slot.kwargs
        return LatentLayout(device=torch.device(slot.device),
                            index_device=None if indexer is None else torch.device(indexer.device),
                            fp8="fp8" in (kv_dtype, k["kv_dtype"]), offload=k["kv_offload"], hot_bytes=k["hot_budget"],
                            window=k["window"], prefill_rows=k["prefill_rows"])

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """Latent rows per token on the attention's device, or with offload in host memory beside a hot buffer (its
        rows and LRU tables), a 4-byte slot per token and a prefill staging buffer of prefill_rows rows (shared by the
        layers) on the device; FP8 rows add one buffer of as many rows in bf16 (a prefill chunk's sparse MLA converts
        its rows once: shared; without offload, one of every row); the indexer keys per token on the indexer's device;
        the reference's [heads, queries, keys] temporaries."""
        layout = self.layout(slot, "fp8" if ctx.kv_dtype == "fp8" else None)
        form = "fp8" if layout.fp8 else ctx.kv_dtype or dtype_name(ctx.dtype)
        row = latent_row_bytes(ctx.config, form)
        staged = min(layout.prefill_rows, ctx.max_seq_len)
        buffers = super().memory(slot, ctx) + [
            Buffer("cpu" if layout.offload else slot.device, "latent_kv", per_token=row,
                   note=f"latent KV {form} ({row} B/token/layer)"),
            Buffer(slot.device, "workspace", 3 * SCORE_BUDGET * TEMPORARY_BYTES)]
        if layout.offload:
            buffers += [Buffer(slot.device, "latent_kv", hot_buffer_bytes(layout, row), per_token=SLOT_BYTES),
                        Buffer(slot.device, "latent_kv", staged * row, shared=("prefill staging", form))]
        if form == "fp8":
            bf16_rows = ctx.config.latent_dim * 2
            buffers.append(Buffer(slot.device, "latent_kv", staged * bf16_rows, shared=("FP8 rows in bf16",))
                           if layout.offload else
                           Buffer(slot.device, "latent_kv", per_token=bf16_rows, shared=("FP8 rows in bf16",)))
        if layout.index_device is not None:
            key = key_bytes(ctx.config, form)
            buffers.append(Buffer(str(slot.children["indexer"].device), "indexer_keys", per_token=key,
                                  note=f"indexer keys {key} B/token/full layer"))
        return buffers

    def cache_note(self, slot: Slot, dtype: torch.dtype) -> tuple[str, str]:
        layout = self.layout(slot)
        attention = slot.module
        rows = (f"FP8 rows ({fp8_row_width(attention.kv_lora_rank, attention.rope_dim)} B)" if layout.fp8
                else f"{dtype_name(dtype)} rows")
        where = (f"in pinned host memory, a {human_bytes(layout.hot_bytes)} hot buffer on {slot.device} "
                 f"(the last {layout.window} tokens + recently selected rows)") if layout.offload else f"on {slot.device}"
        return "latent KV", f"{rows} {where}"

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> nn.Module:
        module = super().build(slot, checkpoint, ctx)
        module.latent_layout = self.layout(slot, ctx.kv_dtype)
        return module


def hot_buffer_bytes(layout: LatentLayout, row: int) -> int:
    """A tiered layer's device bytes besides slot_of, as runtime/tiered_kv.py allocates them: the hot rows the budget
    holds and a dummy one, and the LRU slots' tables (the hot rows past the window, and a dummy)."""
    rows = layout.hot_rows(row)
    return (rows + 1) * row + (rows - layout.window + 1) * LRU_SLOT_BYTES


class IndexerOperator(Operator):
    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """Its weights, and the reference's [queries, heads, keys] temporaries (its keys are its attention's)."""
        return super().memory(slot, ctx) + [Buffer(slot.device, "workspace", 3 * SCORE_BUDGET * TEMPORARY_BYTES)]


class KDAOperator(Operator):
    """Kimi Delta Attention: its state lives on its device, fixed-size, twice (the state and the engine's resume
    point)."""

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """Weights; the recurrent state [H, D, D] fp32 and conv inputs [K-1, 3HD], twice; a prefill chunk's
        temporaries, counted once: the larger of the chunked reference's [H, 64, 64, D] gate differences and about
        ten fp32 [tokens, H, D] tensors (q, k, v, gates and their transforms, fla-core's states every 64 tokens)."""
        c = ctx.config
        H, D = c.linear_num_heads, c.linear_head_dim
        state = H * D * D * 4 + (c.linear_conv_kernel_dim - 1) * 3 * H * D * ctx.dtype.itemsize
        chunk = max(2 * H * CHUNK * CHUNK * D, 10 * ctx.prefill_chunk * H * D) * TEMPORARY_BYTES
        return super().memory(slot, ctx) + [
            Buffer(slot.device, "latent_kv", 2 * state, note=f"KDA state {human_bytes(state)}/layer (+ resume point)"),
            Buffer(slot.device, "workspace", chunk, shared=("KDA chunk",))]

    def cache_note(self, slot: Slot, dtype: torch.dtype) -> tuple[str, str]:
        return "KDA state", f"fp32 recurrent state on {slot.device}, fixed size"


class ExpertsOperator(Operator):
    """Routed experts: the format they are held in decides their bytes and what a decode token reads of them."""

    def packing(self, slot: Slot, dtype: torch.dtype) -> tuple[str, int]:
        """(format, group size) of the weights: the compute dtype here."""
        return dtype_name(dtype), GROUP

    def format(self, slot: Slot, dtype: torch.dtype) -> str:
        return describe(*self.packing(slot, dtype))

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        """The weights (in --expert-format when given), and a prefill chunk's gate, up and SiLU temporaries."""
        config = ctx.config
        if ctx.expert_format is None:
            weights = Buffer(slot.device, "weights", self.weight_bytes(slot, ctx.dtype),
                             note=f"experts {self.format(slot, ctx.dtype)}")
        else:
            n = sum(t.numel() for t in slot.own_tensors().values())
            weights = Buffer(slot.device, "weights", nbytes(n, ctx.expert_format), note=f"experts {ctx.expert_format}")
        temporaries = ctx.prefill_chunk * config.moe_intermediate_size * 3 * TEMPORARY_BYTES
        return [weights, Buffer(slot.device, "workspace", temporaries)]

    def active_bytes(self, slot: Slot, ctx: PlanContext) -> int:
        """top-k experts x 3 matrices, in the format's bits (payload, no scales)."""
        fmt = ctx.expert_format or self.packing(slot, ctx.dtype)[0]
        bits = BITS.get(fmt) or torch.finfo(ctx.dtype).bits
        c = ctx.config
        return c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size * bits // 8


OPERATORS = (
    Operator("embedding.reference", nn.Embedding, "token embedding lookup"),
    Operator("norm.reference", RMSNorm, "RMSNorm of the residual stream"),
    Operator("linear.reference", Linear, "x W^T with W in the compute dtype (attention, indexer and MLP projections)"),
    AttentionOperator("attention.reference", Attention,
                      "MLA in absorbed latent form over the DSA-selected rows (plain torch)",
                      kwargs=LAYOUT_KWARGS, delegates=(Indexer, PooledIndexer, Linear, RMSNorm)),
    IndexerOperator("indexer.reference", Indexer, "lightning indexer: scores, causal mask, top-k (plain torch)",
                    delegates=(Linear,)),
    IndexerOperator("pooled_indexer.reference", PooledIndexer,
                    "GLM-5.3-Flash's indexer: keys pooled per group of tokens, whole groups selected (plain torch)",
                    delegates=(Linear,)),
    KDAOperator("kda.reference", KDA, "Kimi Delta Attention: convolutions, gates, the delta-rule recurrence (plain "
                "torch; chunked for prefill)", delegates=(Linear,)),
    Operator("hyper_connection.reference", HyperConnection, "mixes the residual streams around a sublayer (mHC)"),
    Operator("mlp.reference", MLP, "SwiGLU MLP: dense layers and the shared expert", delegates=(Linear,)),
    Operator("router.reference", Router, "sigmoid router, correction bias, group-limited top-k"),
    ExpertsOperator("experts.reference", Experts, "routed SwiGLU experts, one loop over the chosen experts"),
    Operator("lm_head.reference", LMHead, "output projection to the vocabulary"),
)
