"""Rows gathered from one table into chosen rows of another, in Triton, where either table may be pinned host memory
read or written by the GPU in place (zero-copy over PCIe: the tiered latent cache's misses and writes).

Reference: `gather_rows_reference` (torch indexing), which is also what runs when both tables are host tensors.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    # dst[dst_rows[i]] = src[src_rows[i]] for src_rows[i] >= 0; rows of WORDS 32-bit words
    i = tl.program_id(0)
    src_row = tl.load(src_rows_ptr + i)
    if src_row >= 0:
        dst_row = tl.load(dst_rows_ptr + i)
        w = tl.arange(0, BLOCK)
        values = tl.load(src_ptr + src_row * WORDS + w, mask=w < WORDS)
        tl.store(dst_ptr + dst_row * WORDS + w, values, mask=w < WORDS)


def gather_rows_triton(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor):
    """dst[dst_rows[i]] = src[src_rows[i]] wherever src_rows[i] >= 0, one program per row. src may be pinned host
    memory while dst is on the GPU (or the other way round): the loads then cross PCIe directly, with no staging
    copy. Rows must be whole 32-bit words."""
    words = src.shape[1] * src.element_size() // 4
    _gather_rows_kernel[(src_rows.numel(),)](src.view(torch.int32), src_rows, dst.view(torch.int32), dst_rows,
                                             WORDS=words, BLOCK=triton.next_power_of_2(words))


def gather_rows_reference(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor):
    keep = src_rows >= 0
    dst[dst_rows[keep]] = src[src_rows[keep]]


def gather_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor):
    """The Triton gather when either side is on a GPU (the other may be pinned host memory), torch's indexing when
    both are host tensors."""
    if src.is_cuda or dst.is_cuda:
        gather_rows_triton(src, src_rows, dst, dst_rows)
    else:
        gather_rows_reference(src, src_rows, dst, dst_rows)
