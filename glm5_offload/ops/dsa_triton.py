"""`attention.dsa_triton`, `indexer.dsa_triton` and `pooled_indexer.dsa_triton`: the same modules with their cores
in Triton kernels (kernels/dsa_triton.py).

Weights, cache layout and IndexShare behaviour are the reference's (model/mla.py): a shared layer still runs no
indexer and keeps no indexer cache. Decode selects with kernels/topk_triton.py's radix select, a prefill chunk's
rows over 64K keys by a sample's threshold (topk_triton.topk_sampled; torch.topk with sampled_topk false), shorter
ones and the pooled indexer's (index_kpool times shorter) with torch.topk. FP8 indexer keys are roped and quantised
by one kernel straight into the cache rows, FP8 latent rows likewise (k_pe's rope, the cat with c and the
quantisation: dsa_triton.quantize_latent); a decode step's query rope runs in absorbed MLA's W_UK launch
(mla_absorb.absorb_query), its indexer queries' in the score kernel (UnropedQueries); a prefill's indexer queries, and
its MLA ropes, take kernels/rope_triton.py's kernel on a GPU (on the CPU torch's: in Triton's interpreter each launch
costs some 10 ms). A decode step's indexer head weights (weights_proj's fp32 GEMV and the scale) are one launch
(dsa_triton.head_weights).
"""

from typing import NamedTuple

import torch

from ..errors import Glm5Error
from ..formats.kv_rows import FP8Keys
from ..kernels import INTERPRET, dsa_triton, linear_triton, mla_absorb, rope_triton, topk_triton
from ..model import SCORE_BUDGET, Attention, Indexer, Linear, PooledIndexer, RMSNorm, indexer_scores, mla
from ..model.pooled_indexer import last_complete_group
from .linear_triton import QuantLinear
from .reference import LAYOUT_KWARGS, AttentionOperator, IndexerOperator

DEVICES = ("cuda", "cpu") if INTERPRET else ("cuda",)  # the CPU only in Triton's interpreter (the tests)
RADIX_ROWS = 4  # score rows up to which the radix select beats torch.topk (H200: 1 row 46 us against 133;
# 16 rows 451 us against 281)


def head_weights(indexer, x) -> torch.Tensor:
    """An indexer's head weights (Indexer.head_weights): of decode rows on a GPU in one launch
    (dsa_triton.head_weights), where its weights_proj is the plain fp32 Linear the model keeps; else the reference's."""
    proj = indexer.weights_proj
    if (x.is_cuda and x.shape[0] <= linear_triton.DECODE_ROWS and type(proj) is Linear
            and proj.weight.dtype == torch.float32 and proj.weight.device == x.device):
        return dsa_triton.head_weights(x, proj.weight, indexer.n_heads**-0.5)
    return mla.head_weights(proj, x, indexer.n_heads)


class UnropedQueries(NamedTuple):
    """A decode step's indexer queries q [S, H, D] before their rope, which the score kernel applies as it loads them
    (cos, sin [S, rope_dim/2]): TritonIndexer.query's, for its selected."""
    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class TritonIndexer(Indexer):
    fp8_queries = True  # the rule's kwarg: a prefill over FP8 keys on an FP8 GPU quantises its queries too
    sampled_topk = True  # the rule's kwarg: a prefill's wide rows take topk_triton.topk_sampled

    def query(self, qr, cos, sin):
        """Decode rows: wq_b's queries, their rope left to the score kernel (UnropedQueries: a launch fewer)."""
        if qr.shape[0] > dsa_triton.DECODE_QUERIES or not self.rope_dim:
            return super().query(qr, cos, sin)
        return UnropedQueries(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim), cos, sin)

    def selected(self, q, keys, weights, positions, end: int):
        if not isinstance(q, UnropedQueries):
            return super().selected(q, keys, weights, positions, end)
        if q.q.shape[0] > self.query_chunk(end):  # scored in parts (beyond 2^25 keys): roped first
            return super().selected(self._rope(*q), keys, weights, positions, end)
        return self.top(q, keys, weights, positions, end)

    def scores(self, q, keys, weights, positions, end):
        rope = None
        if isinstance(q, UnropedQueries):
            q, rope = q.q, (q.cos, q.sin, self.rope_dim, self.interleaved)
        if isinstance(keys, FP8Keys):
            return dsa_triton.indexer_scores(q, keys.values[:end], weights, positions, key_scales=keys.scales[:end],
                                             q_fp8=None if self.fp8_queries else False, rope=rope)
        return dsa_triton.indexer_scores(q, keys[:end], weights, positions, rope=rope)

    def head_weights(self, x):
        return head_weights(self, x)

    def _rope(self, t, cos, sin):
        if not t.is_cuda:
            return super()._rope(t, cos, sin)
        return rope_triton.rope(t, cos, sin, self.rope_dim, self.interleaved)

    def write_keys(self, k, cos, sin, keys, positions):
        """FP8 rows: rope and quantisation in one kernel, straight into the cache rows at positions (on a GPU; on the
        CPU the reference's, as for rope: the interpreter's launch per key cost minutes of the CPU suite, and its e4m3
        conversion drops a rounding carry that the GPU's and torch's keep; the kernel has its own tests)."""
        if not isinstance(keys, FP8Keys) or not k.is_cuda:
            return super().write_keys(k, cos, sin, keys, positions)
        dsa_triton.rope_quantize_keys(k, cos, sin, self.rope_dim, self.interleaved, keys.values, keys.scales,
                                      rows=positions)

    def select(self, scores):
        """Decode rows (up to 4) by the radix select; more at once (a prefill's) by the sampled threshold where they
        are wide (sampled_topk), else by torch.topk, faster there than the radix select (bench/RESULTS.md)."""
        if scores.shape[0] <= RADIX_ROWS:
            return topk_triton.topk_indices(scores, self.topk)
        if self.sampled_topk and scores.shape[1] >= topk_triton.SAMPLED_WIDTH and 2 * self.topk <= topk_triton.CAP:
            return topk_triton.topk_sampled(scores, self.topk)
        return super().select(scores)

    def query_chunk(self, n_keys: int) -> int:
        """The kernel sums over heads as it goes: only [queries, keys] scores are held."""
        return max(1, 2 * SCORE_BUDGET // n_keys)


class TritonPooledIndexer(PooledIndexer):
    def head_weights(self, x):
        return head_weights(self, x)

    def scores(self, q, cache, weights, positions, end):
        """The indexer kernel over the group keys, its causal mask at each query's last complete group."""
        groups = cache.groups[: end // self.kpool]
        last = last_complete_group(positions, self.kpool)
        if not groups.shape[0]:  # fewer tokens than a group: nothing to score (no empty launch)
            return indexer_scores(q, groups, weights, last)
        return dsa_triton.indexer_scores(q, groups, weights, last)


class TritonAttention(Attention):
    def rope(self, t, cos, sin):
        if not t.is_cuda:
            return super().rope(t, cos, sin)
        return rope_triton.rope(t, cos, sin, self.rope_dim, self.interleaved)

    def attend(self, q_lat, q_pe, latent, indices, span=None, into=None):
        o, lse = (None, None) if into is None else into
        return dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, self.kv_lora_rank, self.scale, span=span, out=o,
                                     lse=lse, accumulate=into is not None)

    def write_latent(self, kv_a, cos, sin, cache, positions):
        """FP8 rows on a GPU (or in Triton's interpreter: the same bytes as the reference's): k_pe's rope, the cat and
        the quantisation in one launch (dsa_triton.quantize_latent)."""
        if not ((kv_a.is_cuda or INTERPRET) and self.latent_layout.fp8 and self.rope_dim):
            return super().write_latent(kv_a, cos, sin, cache, positions)
        c, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        rows = dsa_triton.quantize_latent(self.kv_a_layernorm(c), self.kv_lora_rank, rope=(k_pe, cos, sin,
                                                                                            self.interleaved))
        cache.write_latent(self.layer, positions, rows)

    def query(self, qr, cos, sin, w):
        """Decode rows (w a stored kv_b_proj, kv_b_weight) with a rope part: its rope in absorb_query's launch."""
        if not isinstance(w, tuple) or not self.rope_dim:
            return super().query(qr, cos, sin, w)
        q_nope, q_pe = self.query_parts(qr)
        # q_lat as sparse MLA reads it: bf16 on a GPU in a bf16 model (no copy kernel before it), fp32 in Triton's
        # interpreter (dsa_triton.sparse_mla's cast)
        return mla_absorb.absorb_query(q_nope, *w, self.nope + self.v_dim, rope=(q_pe, cos, sin, self.interleaved),
                                       out_dtype=qr.dtype if qr.is_cuda and qr.dtype == torch.bfloat16
                                       else torch.float32)

    def kv_b_weight(self, x):
        """Decode rows with an fp8 or dense kv_b_proj on x's device: (weight, scales or None, the dtype it
        dequantises to) as stored, for mla_absorb's kernels. Else (prefill chunks, int4) the reference's dense W."""
        kv_b = self.kv_b_proj
        if x.shape[0] > linear_triton.DECODE_ROWS or kv_b.weight.device != x.device:
            return super().kv_b_weight(x)
        if isinstance(kv_b, QuantLinear):
            return (kv_b.weight, kv_b.scales, kv_b.compute_dtype) if kv_b.fmt == "fp8" else super().kv_b_weight(x)
        return kv_b.weight, None, kv_b.weight.dtype

    # On a GPU a prefill chunk's products (dense W) go in W's dtype, the compute dtype, on tensor cores for bf16:
    # sparse_mla reads its queries in bf16 there anyway, and the output is cast to it (the reference's fp32 einsums:
    # ~30 TFLOP a layer of a 1M prefill at the fp32 rate). On the CPU (the interpreter) the kernels and these
    # products compute in fp32, as the reference does.
    def absorb_query(self, q_nope, w):
        if isinstance(w, tuple):
            return mla_absorb.absorb_query(q_nope, *w, self.nope + self.v_dim)
        if not w.is_cuda:
            return super().absorb_query(q_nope, w)
        return torch.einsum("shd,hdl->shl", q_nope.to(w.dtype), w[:, : self.nope])

    def absorb_output(self, o, w, dtype):
        if isinstance(w, tuple):
            return mla_absorb.absorb_output(o, *w, self.nope, self.nope + self.v_dim, out_dtype=dtype)
        if not w.is_cuda:
            return super().absorb_output(o, w, dtype)
        return torch.einsum("shl,hvl->shv", o.to(w.dtype), w[:, self.nope :]).to(dtype)


class TritonIndexerOperator(IndexerOperator):
    """kwargs: fp8_queries (default true): over FP8 keys on a GPU with FP8 tensor cores, a prefill chunk's queries go
    to e4m3 per (query, head) and the scores take FP8 dots, as DeepSeek's indexer and vLLM's do (faster; selections
    near a tie can differ from bf16 queries'); false keeps them in the compute dtype. sampled_topk (default true): a
    prefill's rows of 65536 keys and more take their top-k by a sample's threshold and one read of the scores
    (topk_triton.topk_sampled: torch.topk's set, ties lowest position first); false: torch.topk."""

    def parse_kwargs(self, kwargs: dict) -> dict:
        parsed = {name: kwargs.get(name, default) for name, default in (("fp8_queries", True), ("sampled_topk", True))}
        for name, value in parsed.items():
            if not isinstance(value, bool):
                raise Glm5Error(f"{name} must be true or false, got {value!r}")
        return parsed

    def build(self, slot, checkpoint, ctx):
        module = super().build(slot, checkpoint, ctx)
        module.fp8_queries, module.sampled_topk = slot.kwargs["fp8_queries"], slot.kwargs["sampled_topk"]
        return module


OPERATORS = (
    AttentionOperator("attention.dsa_triton", Attention, "MLA over the selected rows in a Triton kernel",
                      kwargs=LAYOUT_KWARGS, delegates=(Indexer, PooledIndexer, Linear, RMSNorm), devices=DEVICES,
                      module_class=TritonAttention),
    TritonIndexerOperator("indexer.dsa_triton", Indexer, "lightning indexer scores and top-k in Triton kernels",
                          kwargs=("fp8_queries", "sampled_topk"), delegates=(Linear,), devices=DEVICES,
                          module_class=TritonIndexer),
    IndexerOperator("pooled_indexer.dsa_triton", PooledIndexer, "GLM-5.3-Flash's group scores in the indexer's "
                    "Triton kernel, torch.topk", delegates=(Linear,), devices=DEVICES,
                    module_class=TritonPooledIndexer),
)
