"""Exact top-k of long score rows on the GPU: a radix select in Triton.

Reference: `topk_indices` in glm5_offload/model/mla.py (torch.topk; -1 where the score is -inf). The same set of
positions comes back, ties at the k-th value taken lowest position first, in a fixed order: the positions above the
k-th value, then the tied ones, each ascending (a CUDA graph's replay equals eager; no atomics decide the output).

Scores map to uint32 keys ordered as the floats are. Four passes over a row each count, in a histogram of 256
bins, the next 8 bits of the keys that share the bits chosen so far; the row is split over many programs that add
their histograms into the row's. Each pass's programs start from the bits the previous pass started from (and how
many of the top k were still to be found among the keys that share them) and that pass's histogram, choose the
next 8 bits, and the first program records them for the next pass: one dependent load a pass. After the fourth,
the k-th largest key is known; one pass counts each program's keys above and equal to it, and the last writes the
positions, each program at the offset the counts before it give. Inside a CUDA graph a pass costs a few
microseconds whatever it does, so the passes are few (bench/RESULTS.md: 8 passes of 4 bits were slower). A row of
at most ROW_PROGRAM_WIDTH scores (a decode step's within a 4K context) takes one program that makes every pass itself
(_row_topk_kernel: one launch; a row of one block keeps its keys in registers and stops at the first digit whose keys
are all taken, _block_topk); its pieces (_kth_of_row, _write_top_of_row) also choose the tiered cache's LRU
victims inside kernels/hot_rows.py's fetch.
"""


import torch
import triton
import triton.language as tl

from . import INTERPRET, programs_wanted

BITS = 8  # a pass's digit
LEVELS = 32 // BITS
BLOCK = 4096  # scores a program reads per iteration
MAX_PROGRAMS = 256  # programs per row
ROW_PROGRAM_WIDTH = 4096  # rows up to this wide: one program a row does every pass, in one launch (H200, a row's
# top-2048: 17.9 us against 26.4 for the passes below at 4096 wide; each block more costs it ~4 us a pass: 63 against
# 27 at 16384, bench/RESULTS.md; H100, its keys in registers: 10.9 at 4096; a block of 8192 in registers, 16 warps, ties
# the passes, 27.1 against 28.1, and 16384 loses, 69.5 against 28.2: session 60)


@triton.jit
def _keys(x):
    """fp32 -> uint32 keys in the floats' order (negative floats' bits flipped, positive ones' sign bit set)."""
    i = x.to(tl.int32, bitcast=True)
    return (i ^ ((i >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _chosen(hist_row, state_row, k, LEVEL: tl.constexpr, BITS: tl.constexpr):
    """The key bits chosen by the first LEVEL passes and how many keys of the top k remain to be found among the
    keys that start with them: from state[LEVEL - 1] (the same for LEVEL - 1 passes; written by the previous pass's
    first program) and pass LEVEL - 1's histogram hist_row[LEVEL - 1] [2^BITS]."""
    if LEVEL == 0:
        return tl.zeros((), tl.uint32), k
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.load(state_row + 2 * (LEVEL - 1)).to(tl.uint32, bitcast=True)
    remaining = tl.load(state_row + 2 * (LEVEL - 1) + 1)
    h = tl.load(hist_row + (LEVEL - 1) * (1 << BITS) + bins)
    return _pick_digit(h, prefix, remaining, BITS)


@triton.jit
def _pick_digit(h, prefix, remaining, BITS: tl.constexpr):
    """From a pass's histogram h [2^BITS] of the next digit of the keys that start with prefix, of which `remaining`
    are still to be found among the top k: the prefix one digit longer, and how many remain to be found among the
    keys that start with it."""
    bins = tl.arange(0, 1 << BITS)
    at_or_above = tl.sum(h) - tl.cumsum(h, 0) + h  # keys in this bin or higher ones
    digit = tl.sum((at_or_above >= remaining).to(tl.int32)) - 1  # the highest bin that reaches the k-th
    return (prefix << BITS) | digit.to(tl.uint32), remaining - tl.sum(tl.where(bins > digit, h, 0))


@triton.jit
def _record(state_row, prefix, remaining, LEVEL: tl.constexpr):
    """The first program of a row keeps what _chosen found for the next pass."""
    if tl.program_id(1) == 0:
        tl.store(state_row + 2 * LEVEL, prefix.to(tl.int32, bitcast=True))
        tl.store(state_row + 2 * LEVEL + 1, remaining)


@triton.jit
def _histogram_kernel(scores_ptr, hist_ptr, state_ptr, skip_ptr, T, k, per_program, LEVEL: tl.constexpr,
                      BITS: tl.constexpr, BLOCK: tl.constexpr, SKIP: tl.constexpr):
    # scores [rows, T] fp32; hist [rows, LEVELS, 2^BITS] int32 (zeroed); state [rows, LEVELS + 1, 2] int32;
    # program (row, p) reads scores[row, p*per_program:][:per_program]; SKIP: rows where skip [rows] is set are left
    row, p = tl.program_id(0), tl.program_id(1)
    if SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    hist_row = hist_ptr + row * (32 // BITS) * (1 << BITS)
    state_row = state_ptr + row * 2 * (32 // BITS + 1)
    prefix, remaining = _chosen(hist_row, state_row, k, LEVEL, BITS)
    _record(state_row, prefix, remaining, LEVEL)
    start = p * per_program
    counts = _digit_counts(scores_ptr + row.to(tl.int64) * T, start, tl.minimum(start + per_program, T), prefix, 0, 0,
                           False, LEVEL, BITS, BLOCK)
    tl.atomic_add(hist_row + LEVEL * (1 << BITS) + tl.arange(0, 1 << BITS), counts, mask=counts > 0)


@triton.jit
def _count_kernel(scores_ptr, hist_ptr, state_ptr, counts_ptr, skip_ptr, T, k, per_program, BITS: tl.constexpr,
                  BLOCK: tl.constexpr, SKIP: tl.constexpr):
    # counts [rows, programs, 2] int32: this program's keys above the k-th largest, and equal to it
    row, p = tl.program_id(0), tl.program_id(1)
    if SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    state_row = state_ptr + row * 2 * (32 // BITS + 1)
    kth, ties = _chosen(hist_ptr + row * (32 // BITS) * (1 << BITS), state_row, k, 32 // BITS, BITS)
    _record(state_row, kth, ties, 32 // BITS)
    start = p * per_program
    end = tl.minimum(start + per_program, T)
    above = tl.zeros((), tl.int32)
    equal = tl.zeros((), tl.int32)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        ok = t < end
        key = _keys(tl.load(scores_ptr + row.to(tl.int64) * T + t, mask=ok, other=0.0))
        above += tl.sum((ok & (key > kth)).to(tl.int32))
        equal += tl.sum((ok & (key == kth)).to(tl.int32))
    base = counts_ptr + (row * tl.num_programs(1) + p) * 2
    tl.store(base, above)
    tl.store(base + 1, equal)


@triton.jit
def _write_kernel(state_ptr, scores_ptr, counts_ptr, out_ptr, skip_ptr, T, k, per_program, BITS: tl.constexpr,
                  BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, SKIP: tl.constexpr):
    # out [rows, k] int64: the row's positions above the k-th largest, then `ties` of those equal to it, each
    # ascending; -1 for a position whose score is -inf
    row, p = tl.program_id(0), tl.program_id(1)
    if SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    state_row = state_ptr + row * 2 * (32 // BITS + 1) + 2 * (32 // BITS)
    kth, ties = tl.load(state_row).to(tl.uint32, bitcast=True), tl.load(state_row + 1)
    others = tl.arange(0, PROGRAMS)
    row_counts = counts_ptr + row * tl.num_programs(1) * 2 + others * 2
    real = others < tl.num_programs(1)
    above_before = tl.sum(tl.load(row_counts, mask=real & (others < p), other=0))
    equal_before = tl.sum(tl.load(row_counts + 1, mask=real & (others < p), other=0))
    start = p * per_program
    _write_top(scores_ptr + row.to(tl.int64) * T, start, tl.minimum(start + per_program, T), k - ties, k, kth,
               above_before, equal_before, out_ptr + row.to(tl.int64) * k, 0, 0, False, BLOCK)


@triton.jit
def _row_keys(ptr, t, ok, step, OLDEST: tl.constexpr, AGES: tl.constexpr):
    """Keys at positions t of a row (ok: which exist): of fp32 scores (_keys), or (AGES) of int64 stamps their ages
    step - stamp, clamped at OLDEST (< 2^24: their top byte is 0)."""
    if AGES:
        key = tl.minimum(step - tl.load(ptr + t, mask=ok, other=0), OLDEST).to(tl.uint32)
    else:
        key = _keys(tl.load(ptr + t, mask=ok, other=0.0))
    return key


@triton.jit
def _digit_counts(ptr, start, end, prefix, step, OLDEST: tl.constexpr, AGES: tl.constexpr, LEVEL: tl.constexpr,
                  BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass LEVEL's histogram [2^BITS] over positions start..end-1 of a row (_row_keys): the next digit of the keys
    that start with the LEVEL digits of prefix."""
    counts = tl.zeros((1 << BITS,), tl.int32)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        ok = t < end
        key = _row_keys(ptr, t, ok, step, OLDEST, AGES)
        if LEVEL > 0:
            ok = ok & ((key >> (32 - BITS * LEVEL)) == prefix)
        counts += tl.histogram(((key >> (32 - BITS * (LEVEL + 1))) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS,
                               mask=ok)
    return counts


@triton.jit
def _write_top(ptr, start, end, n_above, limit, kth, above_before, equal_before, out_ptr, step, OLDEST: tl.constexpr,
               AGES: tl.constexpr, BLOCK: tl.constexpr):
    """The top k's positions among start..end-1 of a row (_row_keys; the k-th largest key kth, n_above keys above
    it in the row), each at its rank in topk_indices' order: out[rank] for rank < limit (<= k), -1 for a -inf
    score. above_before / equal_before: the row's keys above / equal to kth before start; returned with those of
    start..end-1 added."""
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        ok = t < end
        key = _row_keys(ptr, t, ok, step, OLDEST, AGES)
        above_before, equal_before = _store_top(key, t, ok, kth, n_above, limit, above_before, equal_before, out_ptr,
                                                AGES)
    return above_before, equal_before


@triton.jit
def _store_top(key, t, ok, kth, n_above, limit, above_before, equal_before, out_ptr, AGES: tl.constexpr):
    """_write_top's work on one block of keys at positions t (ok: which exist): their top-k positions stored at their
    ranks; above_before / equal_before returned with the block's added."""
    value = t.to(tl.int64) if AGES else tl.where(key == 0x007FFFFF, -1, t).to(tl.int64)  # _keys(-inf)
    is_above = ok & (key > kth)
    rank = above_before + tl.cumsum(is_above.to(tl.int32), 0) - 1
    tl.store(out_ptr + rank, value, mask=is_above & (rank < limit))
    is_equal = ok & (key == kth)
    rank_equal = n_above + equal_before + tl.cumsum(is_equal.to(tl.int32), 0) - 1
    tl.store(out_ptr + rank_equal, value, mask=is_equal & (rank_equal < limit))
    return above_before + tl.sum(is_above.to(tl.int32)), equal_before + tl.sum(is_equal.to(tl.int32))


@triton.jit
def _kth_of_row(ptr, T, k, step, OLDEST: tl.constexpr, AGES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One program's radix select over a row of T keys (_row_keys): the k-th largest key, and how many of the keys
    equal to it are among the top k. 32 / BITS passes over the row (ages: one fewer, their top byte is 0), each
    BLOCK keys at a time."""
    prefix = tl.zeros((), tl.uint32)
    remaining = tl.zeros((), tl.int32) + k
    for level in tl.static_range(8 // BITS if AGES else 0, 32 // BITS):
        counts = _digit_counts(ptr, 0, T, prefix, step, OLDEST, AGES, level, BITS, BLOCK)
        prefix, remaining = _pick_digit(counts, prefix, remaining, BITS)
    return prefix, remaining


@triton.jit
def _write_top_of_row(ptr, T, k, kth, ties, limit, out_ptr, step, OLDEST: tl.constexpr, AGES: tl.constexpr,
                      BLOCK: tl.constexpr):
    """The positions of the row's top k (_kth_of_row's kth and ties) in topk_indices' order, those of rank < limit
    (<= k): out[rank] (-1 for a -inf score). The scan stops once every rank below limit is written (a fetch's few
    misses take the first victims: a block)."""
    n_above = k - ties
    above = tl.zeros((), tl.int32)
    equal = tl.zeros((), tl.int32)
    first = 0
    while (first < T) & ((above < tl.minimum(n_above, limit)) | (n_above + equal < limit)):
        above, equal = _write_top(ptr, first, tl.minimum(first + BLOCK, T), n_above, limit, kth, above, equal, out_ptr,
                                  step, OLDEST, AGES, BLOCK)
        first += BLOCK


@triton.jit
def _block_topk(ptr, T, k, out_ptr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The whole select over a row of T <= BLOCK fp32 scores, its keys read once and kept in registers. The passes
    stop early once every key that starts with the chosen digits is among the top k (then the least of them is the
    k-th, and every key equal to it is taken): after two or three digits on most rows, not four."""
    t = tl.arange(0, BLOCK)
    ok = t < T
    key = _keys(tl.load(ptr + t, mask=ok, other=0.0))
    group = ok  # the keys that start with the digits chosen so far
    prefix = tl.zeros((), tl.uint32)
    remaining = tl.zeros((), tl.int32) + k
    bins = tl.arange(0, 1 << BITS)
    level = 0
    taken = 0  # every key of the group is among the top k
    while (level < 32 // BITS) & (taken == 0):
        shift = (32 - BITS * (level + 1)).to(tl.uint32)
        h = tl.histogram(((key >> shift) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS, mask=group)
        prefix, remaining = _pick_digit(h, prefix, remaining, BITS)
        group = group & ((key >> shift) == prefix)
        taken = (tl.sum(tl.where(bins == (prefix & ((1 << BITS) - 1)).to(tl.int32), h, 0)) == remaining).to(tl.int32)
        level += 1
    kth = tl.min(tl.where(group, key, 0xFFFFFFFF), 0)
    ties = tl.where(taken != 0, tl.sum((group & (key == kth)).to(tl.int32)), remaining)
    _store_top(key, t, ok, kth, k - ties, k, 0, 0, out_ptr, False)


@triton.jit
def _row_topk_kernel(scores_ptr, out_ptr, T, k, BITS: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    # scores [rows, T] fp32 -> out [rows, k] int64: one program a row, the whole select (ONE_BLOCK: T <= BLOCK)
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:
        _block_topk(scores_ptr + row * T, T, k, out_ptr + row * k, BITS, BLOCK)
    else:
        kth, ties = _kth_of_row(scores_ptr + row * T, T, k, 0, 0, False, BITS, BLOCK)
        _write_top_of_row(scores_ptr + row * T, T, k, kth, ties, k, out_ptr + row * k, 0, 0, False, BLOCK)


def row_split(scores: torch.Tensor, wanted: int) -> tuple[int, int]:
    """(programs a row, scores each reads: whole BLOCKs) for rows of scores [S, T]: about `wanted` programs a row,
    at most MAX_PROGRAMS, at least one BLOCK each."""
    T = scores.shape[1]
    programs = max(1, min(MAX_PROGRAMS, wanted, triton.cdiv(T, BLOCK)))
    per_program = triton.cdiv(triton.cdiv(T, programs), BLOCK) * BLOCK
    return triton.cdiv(T, per_program), per_program


def topk_indices(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of the top min(k, T) scores of each row of scores [S, T] fp32 -> [S, min(k, T)] int64, -1 where the
    score is -inf (model.mla.topk_indices' set; ties lowest position first, in the order the docstring gives).
    skip [S] bool: rows of out left as they are (their programs return at once)."""
    S, T = scores.shape
    k = min(k, T)
    out = torch.empty(S, k, dtype=torch.int64, device=scores.device) if out is None else out
    if S == 0 or k == 0:
        return out
    scores = scores.float().contiguous()
    if skip is None and T <= ROW_PROGRAM_WIDTH:
        _row_topk_kernel[(S,)](scores, out, T, k, BITS=BITS, BLOCK=BLOCK, ONE_BLOCK=T <= BLOCK, num_warps=8)
        return out
    programs, per_program = row_split(scores, programs_wanted(scores.device) // S)
    hist = torch.zeros(S, LEVELS, 1 << BITS, dtype=torch.int32, device=scores.device)
    state = torch.empty(S, LEVELS + 1, 2, dtype=torch.int32, device=scores.device)
    counts = torch.empty(S, programs, 2, dtype=torch.int32, device=scores.device)
    grid = (S, programs)
    flags = counts if skip is None else skip.to(torch.int8)  # (not read without skip)
    for level in range(LEVELS):
        _histogram_kernel[grid](scores, hist, state, flags, T, k, per_program, LEVEL=level, BITS=BITS, BLOCK=BLOCK,
                                SKIP=skip is not None, num_warps=8)
    _count_kernel[grid](scores, hist, state, counts, flags, T, k, per_program, BITS=BITS, BLOCK=BLOCK,
                        SKIP=skip is not None, num_warps=8)
    _write_kernel[grid](state, scores, counts, out, flags, T, k, per_program, BITS=BITS, BLOCK=BLOCK,
                        PROGRAMS=triton.next_power_of_2(programs), SKIP=skip is not None, num_warps=8)
    return out


# Many wide rows (a prefill chunk's indexer calls: 128 rows of 1M scores), faster than torch.topk's passes: a strided
# sample of SAMPLE scores a row gives a threshold that about 4k scores pass (the sample's 4k/T quantile); one read of
# the row keeps the scores at or above it as candidates, with their positions, in 64-bit keys ordered as (score,
# lower position first); torch.topk of the candidates is the row's top-k whenever at least k and at most CAP passed:
# everything left out scores below everything kept. A row where the sample misled (too few or too many passed:
# misled_rows) is redone by the radix select above, its programs for the other rows returning at once.
SAMPLE = 4096
CAP = 16384  # candidates kept per row: 4x the 4k expected at k 2048 (a miss needs a sample 5 sigma off)
SAMPLED_WIDTH = 4 * CAP  # rows at least this wide take the sampled path (narrower ones: torch.topk is quick)
CANDIDATE_ROWS, CANDIDATE_WIDTH = 32, 128  # a candidates program's block of scores: 32 runs of 128
CANDIDATE_PROGRAMS = 64  # programs a row (32 to 128 ran alike on an H200: bench/RESULTS.md)
_NEG_INF_KEY = 0x007FFFFF  # _keys(-inf)


@triton.jit
def _candidates_kernel(scores_ptr, thr_ptr, count_ptr, cand_ptr, T, per_program, ROWS: tl.constexpr,
                       WIDTH: tl.constexpr, CAP: tl.constexpr):
    # scores [S, T] fp32, thr [S] fp32, count [S] int32 (zeroed), cand [S, CAP] int64; program (row, p) reads
    # scores[row, p*per_program:][:per_program] in blocks [ROWS, WIDTH]: a block's candidates (~1%) take slots
    # by one atomic on the row's count, each at its offset from two scans (the runs' counts, then within a run)
    row, p = tl.program_id(0), tl.program_id(1)
    least = tl.maximum(_keys(tl.load(thr_ptr + row)), 0x00800000)  # _keys(-inf) + 1: -inf is never a candidate
    start = p * per_program
    end = tl.minimum(start + per_program, T)
    for first in range(start, end, ROWS * WIDTH):
        t = first + tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
        ok = t < end
        key = _keys(tl.load(scores_ptr + row.to(tl.int64) * T + t, mask=ok, other=float("-inf")))
        take = (ok & (key >= least)).to(tl.int32)
        per_run = tl.sum(take, 1)
        n = tl.sum(per_run)
        if n > 0:
            base = tl.atomic_add(count_ptr + row, n, sem="relaxed")
            slot = (base + tl.cumsum(per_run, 0) - per_run)[:, None] + tl.cumsum(take, 1) - 1
            signed = (key ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
            composite = (signed << 32) | (4294967295 - t.to(tl.int64))
            tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, composite, mask=(take != 0) & (slot < CAP))


def sample_threshold(sample: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[S] fp32: the threshold that about 4k of a row's T scores pass, from its scores at every (T // SAMPLE)-th
    position sample [S, n] (-inf: every finite score is a candidate)."""
    rank = min(sample.shape[1], -(-4 * k * sample.shape[1] // T))
    return sample.topk(rank, dim=1).values[:, -1].contiguous()


def top_candidates(cand: torch.Tensor, k: int) -> torch.Tensor:
    """The positions [S, k] int64 of the k highest candidates of each row, by score (-1 where it is -inf)."""
    top = cand.topk(k, dim=1).values
    return (0xFFFFFFFF - (top & 0xFFFFFFFF)).masked_fill_((top >> 32) < _NEG_INF_KEY + 1 - (1 << 31), -1)


def misled_rows(count: torch.Tensor, thr: torch.Tensor, k: int) -> torch.Tensor:
    """[S] bool: rows whose candidates (count of them, their threshold thr) need not hold the top k: more than CAP
    passed, or fewer than k passed a threshold above -inf."""
    return (count > CAP) | ((count < k) & (thr != float("-inf")))


def candidates(scores: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of scores [S, T] fp32 (contiguous): (count [S] int32 of the scores at or above thr [S], cand [S, CAP]
    int64: the first CAP of them as 64-bit keys, the rest of a row below every key)."""
    S, T = scores.shape
    count = torch.zeros(S, dtype=torch.int32, device=scores.device)
    cand = torch.full((S, CAP), torch.iinfo(torch.int64).min, dtype=torch.int64, device=scores.device)
    block = CANDIDATE_ROWS * CANDIDATE_WIDTH
    programs = min(1 if INTERPRET else CANDIDATE_PROGRAMS, triton.cdiv(T, block))
    per_program = triton.cdiv(triton.cdiv(T, programs), block) * block
    _candidates_kernel[(S, triton.cdiv(T, per_program))](scores, thr, count, cand, T, per_program,
                                                         ROWS=CANDIDATE_ROWS, WIDTH=CANDIDATE_WIDTH, CAP=CAP,
                                                         num_warps=4)
    return count, cand


def topk_sampled(scores: torch.Tensor, k: int) -> torch.Tensor:
    """topk_indices' set for wide rows of scores [S, T] fp32 (T >= SAMPLED_WIDTH, k <= CAP // 2) by a sample's
    threshold (the comment above) -> [S, k] int64 by score, -1 where fewer are valid (a redone row: topk_indices'
    order); ties at the k-th score taken lowest position first. Nothing waits for the GPU."""
    S, T = scores.shape
    assert T >= SAMPLED_WIDTH and 2 * k <= CAP, (T, k)
    scores = scores.float().contiguous()
    thr = sample_threshold(scores[:, :: T // SAMPLE], T, k)
    count, cand = candidates(scores, thr)
    out = top_candidates(cand, k)
    return topk_indices(scores, k, out=out, skip=~misled_rows(count, thr, k))
