"""A decode step's bookkeeping of one layer's tiered latent cache (runtime/tiered_kv.py), one kernel each: the new
token's row written, and the rows its query selected made hot. Torch takes some 20 and 50 small kernels for them (in
a CUDA graph each costs 1-3 us whatever it does: a quarter of a GLM-5 layer's GPU time, bench/RESULTS.md); here one
program does each (a decode step's K = 2048 selections are one block), and the misses' rows are then copied by
gather_rows.

Reference: TieredLatent's torch path (`write` and `fetch`, which take any number of tokens); the tests hold the kernels
to it on random cache states, every table equal after each step. The LRU victims are theirs too
(TieredLatent.next_victims): the queue's next slots not used since it was filled, or where too few are left a fresh
select of the K least recently used slots in topk_triton.topk_indices' order, the new queue. While K slots of the
LRU part were never used (TieredLatent.unused: within a context the hot buffer holds, 12.8K of GLM-5's rows in 8
MiB) those are the K least recent and the select needs no pass over the ages; otherwise a one-program radix select
over the slots' ages finds them (~30-50 us for GLM-5's 12K slots, bench/RESULTS.md): once per K misses or so.
"""

import torch
import triton
import triton.language as tl

from .topk_triton import BITS, _kth_of_row, _write_top_of_row

OLDEST = (1 << 24) - 1  # ages up to here are told apart (exact in fp32, as the torch path takes them; their top byte
# is 0: the select skips it); older ones are all "old"
AGE_BLOCK = 4096  # stamps a pass of the victims' select reads at a time
MAX_SELECTIONS = 4096  # a fetch's selections are one block of the program (GLM-5's and DeepSeek-V3.2's: 2048)
FREE_BLOCK = 1024  # LRU slots the write's search for a never-used one reads at a time


@triton.jit
def _write_one_kernel(row_ptr, pos_ptr, host_ptr, hot_ptr, slot_ptr, token_ptr, stamp_ptr, step_ptr, unused_ptr,
                      free_ptr, W, LRU, WORDS: tl.constexpr, BLOCK: tl.constexpr, FREE_BLOCK: tl.constexpr):
    # row [WORDS] int32 of the token at pos[0] -> host[pos] and hot[pos % W] (rows of WORDS words); slot_of[pos] its
    # window slot; the token leaving the window (pos - W) loses its window slot (not an LRU slot it has moved to).
    # The token that leaves at the next write (pos + 1 - W) moves into the lowest never-used LRU slot, if one is
    # left (token_of [LRU + 1] int64 -1, from free[0] on: those below hold rows), stamped with step[0]; unused[0]
    # counts it
    p = tl.load(pos_ptr)
    w = tl.arange(0, BLOCK)
    row = tl.load(row_ptr + w, mask=w < WORDS)
    tl.store(host_ptr + p * WORDS + w, row, mask=w < WORDS)
    tl.store(hot_ptr + (p % W) * WORDS + w, row, mask=w < WORDS)
    leaving = p - W
    if leaving >= 0:
        slot = tl.load(slot_ptr + leaving)
        if (slot >= 0) & (slot < W):
            tl.store(slot_ptr + leaving, -1)
    tl.store(slot_ptr + p, (p % W).to(tl.int32))
    tl.debug_barrier()  # (a window of one: the next to leave is this token, its row and slot just written)
    nxt = p + 1 - W
    if nxt >= 0:
        slot = tl.load(slot_ptr + nxt)
        unused = tl.load(unused_ptr)
        if (slot >= 0) & (slot < W) & (unused > 0):
            start = tl.load(free_ptr)
            found = tl.zeros((), tl.int64) + LRU
            while (found == LRU) & (start < LRU):
                s = start + tl.arange(0, FREE_BLOCK)
                token = tl.load(token_ptr + s, mask=s < LRU, other=0)
                found = tl.min(tl.where((s < LRU) & (token < 0), s, LRU), 0)
                start += FREE_BLOCK
            if found < LRU:
                tl.store(hot_ptr + (W + found) * WORDS + w, tl.load(hot_ptr + slot * WORDS + w, mask=w < WORDS),
                         mask=w < WORDS)
                tl.store(token_ptr + found, nxt)
                tl.store(stamp_ptr + found, tl.load(step_ptr))
                tl.store(slot_ptr + nxt, (W + found).to(tl.int32))
                tl.store(unused_ptr, unused - 1)
                tl.store(free_ptr, found + 1)


@triton.jit
def _fetch_one_kernel(idx_ptr, pos_ptr, slot_ptr, token_ptr, stamp_ptr, step_ptr, hits_ptr, misses_ptr, unused_ptr,
                      queue_ptr, head_ptr, end_ptr, queued_at_ptr, victims_ptr, src_ptr, dst_ptr, mapped_ptr, K, W, LRU,
                      OLDEST: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    # idx [K] int64: the positions the query at pos[0] selected (-1: none); slot_of [max_seq_len + 1] int32,
    # token_of [LRU + 1] int64, stamp [LRU + 1] int64, step / hits / misses / unused 0-d int64, queue [LRU + 1]
    # int32 and its head / end / queued_at 0-d int64: TieredLatent's tables, updated; victims [K] int64 scratch; src,
    # dst [K] int64: the host rows to copy into hot slots (src -1: none); mapped [K] int32: each selection's hot slot
    # (-1: none)
    i = tl.arange(0, BLOCK_K)
    index = tl.load(idx_ptr + i, mask=i < K, other=-1)
    p = tl.load(pos_ptr)
    t = tl.where((index >= 0) & (index < p), index, -1)  # the query's own row is hot: written this step
    valid = t >= 0
    slot = tl.load(slot_ptr + t, mask=valid, other=-1)
    # a window row counts only if it stays in the window: rows of tokens < p + 1 - W leave it this step
    hit = valid & (slot >= 0) & ((slot >= W) | (t >= p + 1 - W))
    miss = valid & (hit == 0)
    step = tl.load(step_ptr) + 1
    tl.store(step_ptr, step)
    tl.store(stamp_ptr + (slot - W), step, mask=hit & (slot >= W))
    n_miss = tl.sum(miss.to(tl.int32))
    tl.store(hits_ptr, tl.load(hits_ptr) + tl.sum(hit.to(tl.int64)))
    tl.store(misses_ptr, tl.load(misses_ptr) + n_miss)
    if n_miss > 0:
        tl.debug_barrier()  # the hits' stamps written: their slots are the youngest, never victims
        # the queue's next K entries, those not used since queued (TieredLatent.next_victims)
        head, queued_at = tl.load(head_ptr), tl.load(queued_at_ptr)
        at = head + i
        inside = (i < K) & (at < tl.load(end_ptr))
        queued = tl.load(queue_ptr + at, mask=inside, other=LRU).to(tl.int64)
        usable = inside & (tl.load(stamp_ptr + queued) < queued_at)
        unused = tl.load(unused_ptr)
        refill = tl.sum(usable.to(tl.int32)) < n_miss
        if refill:  # a fresh select of the K least recent: the queue
            if unused >= K:  # the K least recent are never-used slots (of the oldest age, stamp 0): no passes
                kth, ties = tl.minimum(step, OLDEST).to(tl.uint32), tl.zeros((), tl.int32) + K
            else:
                kth, ties = _kth_of_row(stamp_ptr, LRU, K, step, OLDEST, True, BITS, BLOCK)
            _write_top_of_row(stamp_ptr, LRU, K, kth, ties, K, victims_ptr, step, OLDEST, True, BLOCK)
            tl.debug_barrier()
            queued = tl.load(victims_ptr + i, mask=i < K, other=LRU)
            usable = i < K
            tl.store(queue_ptr + i, queued.to(tl.int32), mask=usable)
            tl.store(end_ptr, K.to(tl.int64))
            tl.store(queued_at_ptr, step)
            head = tl.zeros((), tl.int64)
            tl.debug_barrier()  # the select's answer read before the victims below overwrite it
        rank = tl.cumsum(usable.to(tl.int32), 0) - 1
        take = usable & (rank < n_miss)
        tl.store(victims_ptr + rank, queued, mask=take)
        tl.store(head_ptr, head + tl.max(tl.where(take, i + 1, 0), 0))
        tl.debug_barrier()
        lru_slot = tl.load(victims_ptr + tl.cumsum(miss.to(tl.int32), 0) - 1, mask=miss, other=0)
        evicted = tl.load(token_ptr + lru_slot, mask=miss, other=-1)
        tl.store(unused_ptr, unused - tl.sum((miss & (evicted < 0)).to(tl.int64)))
        tl.store(slot_ptr + evicted, -1, mask=miss & (evicted >= 0))
        tl.store(slot_ptr + t, (lru_slot + W).to(tl.int32), mask=miss)
        tl.store(token_ptr + lru_slot, t, mask=miss)
        tl.store(stamp_ptr + lru_slot, step, mask=miss)
        tl.store(src_ptr + i, tl.where(miss, t, -1), mask=i < K)
        tl.store(dst_ptr + i, lru_slot + W, mask=miss)
    else:
        tl.store(src_ptr + i, tl.full((BLOCK_K,), -1, tl.int64), mask=i < K)
    tl.debug_barrier()  # every slot written before the selections read theirs
    # the query's own row: its window slot, written before attention reads it (a shared layer's fetch runs first)
    mapped = tl.where(index == p, p % W, tl.load(slot_ptr + index, mask=(index >= 0) & (index != p), other=-1))
    tl.store(mapped_ptr + i, mapped.to(tl.int32), mask=i < K)


def write_one(row: torch.Tensor, position: torch.Tensor, host: torch.Tensor, hot: torch.Tensor, slot_of: torch.Tensor,
              token_of: torch.Tensor, stamp: torch.Tensor, step: torch.Tensor, unused: torch.Tensor,
              free_from: torch.Tensor, window: int):
    """TieredLatent.write of one token: row [1, width] at position [1] (int64, on the device) into host (pinned: the
    GPU writes it in place) and the hot window; slot_of updated; the token leaving the window at the next write
    moved into a never-used LRU slot while one is left (TieredLatent.keep_next_leaving). Rows must be whole 32-bit
    words."""
    words = row.shape[1] * row.element_size() // 4
    _write_one_kernel[(1,)](row.contiguous().view(torch.int32), position, host.view(torch.int32),
                            hot.view(torch.int32), slot_of, token_of, stamp, step, unused, free_from, window,
                            token_of.numel() - 1, WORDS=words, BLOCK=triton.next_power_of_2(words),
                            FREE_BLOCK=FREE_BLOCK)


def fetch_one(indices: torch.Tensor, position: torch.Tensor, slot_of: torch.Tensor, token_of: torch.Tensor,
              stamp: torch.Tensor, step: torch.Tensor, hits: torch.Tensor, misses: torch.Tensor, unused: torch.Tensor,
              queue: torch.Tensor, queue_head: torch.Tensor, queue_end: torch.Tensor, queued_at: torch.Tensor,
              window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TieredLatent.fetch of one query's selections indices [K] (int64, distinct, -1 = none) at position [1]: the
    tables updated in place. Returns (src, dst, mapped): the misses' host rows and their hot slots (src -1: none; for
    gather_rows), and each selection's hot slot [K] int32 (slot_of[indices] once the token's row is written)."""
    K = indices.numel()
    src, dst = (torch.empty(K, dtype=torch.int64, device=indices.device) for _ in range(2))
    victims = torch.empty(K, dtype=torch.int64, device=indices.device)
    mapped = torch.empty(K, dtype=torch.int32, device=indices.device)
    _fetch_one_kernel[(1,)](indices, position, slot_of, token_of, stamp, step, hits, misses, unused, queue, queue_head,
                            queue_end, queued_at, victims, src, dst, mapped, K, window, stamp.numel() - 1,
                            OLDEST=OLDEST, BITS=BITS,
                            BLOCK_K=triton.next_power_of_2(K), BLOCK=AGE_BLOCK, num_warps=8)
    return src, dst, mapped
