"""Exact top-k of long rows in Triton: the same index set as torch.topk (ties to the lower index), -1
padding where a row has fewer than k finite scores, many blocks per row so one long row fills the GPU.

Radix select on order-preserving 32-bit keys: four passes of one byte each find the k-th largest key
(histograms per row, built by every block of the row with atomics); then every block writes the
indices of its keys above that threshold, and of the keys equal to it that are among the lowest-index
ones still needed, at positions given by per-block counts. Reference: torch.topk (and
glm5_offload.model.topk_indices, which adds the -1 padding).
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _keys(x_ptr, row, offs, n):
    """Order-preserving uint32 keys of fp32 scores; -inf (and padding past n) maps to 0."""
    x = tl.load(x_ptr + row * n + offs, mask=offs < n, other=float("-inf"))
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x == float("-inf"), 0, key)


@triton.jit
def _block_keys(x_ptr, row, blk, n, BLOCK: tl.constexpr):
    """This program's offsets in its row, their keys, and which are finite scores inside the row."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    key = _keys(x_ptr, row, offs, n)
    return offs, key, (key != 0) & (offs < n)


@triton.jit
def _histogram_kernel(x_ptr, prefix_ptr, hist_ptr, n, shift, BLOCK: tl.constexpr):
    # hist[row, d] += number of this block's keys whose bits above `shift + 8` equal prefix[row] and whose
    # byte at `shift` is d (keys of -inf scores never count)
    row, blk = tl.program_id(0), tl.program_id(1)
    offs, key, valid = _block_keys(x_ptr, row, blk, n, BLOCK)
    prefix = tl.load(prefix_ptr + row).to(tl.uint32)
    high = tl.where(shift == 24, 0, key >> (shift + 8))
    match = (high == prefix) & valid
    digit = ((key >> shift) & 255).to(tl.int32)
    tl.atomic_add(hist_ptr + row * 256 + digit, 1, mask=match)


@triton.jit
def _count_kernel(x_ptr, thr_ptr, counts_ptr, n, n_blocks, BLOCK: tl.constexpr):
    # counts[row, blk] = (keys > threshold, keys == threshold) in this block
    row, blk = tl.program_id(0), tl.program_id(1)
    offs, key, valid = _block_keys(x_ptr, row, blk, n, BLOCK)
    thr = tl.load(thr_ptr + row).to(tl.uint32)
    tl.store(counts_ptr + (row * n_blocks + blk) * 2, tl.sum((valid & (key > thr)).to(tl.int32)))
    tl.store(counts_ptr + (row * n_blocks + blk) * 2 + 1, tl.sum((valid & (key == thr)).to(tl.int32)))


@triton.jit
def _select_kernel(x_ptr, thr_ptr, need_eq_ptr, starts_ptr, out_ptr, n, n_blocks, k, BLOCK: tl.constexpr):
    # starts[row, blk] = (first output slot of this block's ">" keys, rank of its first "==" key)
    row, blk = tl.program_id(0), tl.program_id(1)
    offs, key, valid = _block_keys(x_ptr, row, blk, n, BLOCK)
    thr = tl.load(thr_ptr + row).to(tl.uint32)
    need_eq = tl.load(need_eq_ptr + row)
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    gt_start = tl.load(starts_ptr + (row * n_blocks + blk) * 2)
    eq_start = tl.load(starts_ptr + (row * n_blocks + blk) * 2 + 1)
    gt_rank = gt_start + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    eq_rank = eq_start + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    n_gt = tl.load(need_eq_ptr + row + tl.num_programs(0))  # all ">" keys go first
    tl.store(out_ptr + row * k + gt_rank, offs.to(tl.int64), mask=gt)
    take = eq & (eq_rank < need_eq)
    tl.store(out_ptr + row * k + n_gt + eq_rank, offs.to(tl.int64), mask=take)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, N] fp32 -> indices [R, min(k, N)] int64 of the largest finite scores (ties: lower index),
    as a set in no particular order, -1 where a row has fewer finite scores."""
    rows, n = scores.shape
    k = min(k, n)
    scores = scores.float().contiguous()
    n_blocks = triton.cdiv(n, BLOCK)
    grid = (rows, n_blocks)
    device = scores.device
    prefix = torch.zeros(rows, dtype=torch.int64, device=device)  # the key bits chosen so far
    remaining = torch.full((rows,), k, dtype=torch.int64, device=device)  # how many still to take at/below
    for shift in (24, 16, 8, 0):
        hist = torch.zeros(rows, 256, dtype=torch.int32, device=device)
        _histogram_kernel[grid](scores, prefix, hist, n, shift, BLOCK=BLOCK)
        from_top = hist.flip(1).cumsum(1)  # keys with digit >= 255 - j
        j = (from_top < remaining[:, None]).sum(1).clamp(max=255)  # first j where the count reaches `remaining`
        digit = 255 - j
        above = torch.where(j > 0, from_top.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], 0)
        remaining = remaining - above
        prefix = prefix * 256 + digit
    threshold = prefix  # the k-th largest key (int64 holding a uint32), where a row has k finite scores
    counts = torch.empty(rows, n_blocks, 2, dtype=torch.int32, device=device)
    _count_kernel[grid](scores, threshold, counts, n, n_blocks, BLOCK=BLOCK)
    n_gt = counts[..., 0].sum(1)
    n_eq = counts[..., 1].sum(1)
    need_eq = torch.minimum(k - n_gt, n_eq)  # rows with fewer than k finite scores take all equal ones
    starts = (counts.cumsum(1) - counts).contiguous()  # exclusive prefix over the blocks of each row
    out = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    _select_kernel[grid](scores, threshold, torch.cat([need_eq, n_gt]).to(torch.int32).contiguous(), starts, out, n,
                         n_blocks, k, BLOCK=BLOCK)
    return out
