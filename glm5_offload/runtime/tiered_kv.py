"""One layer's latent rows in two tiers: every row in (pinned) host memory, the hot ones on the GPU.

DSA reads only index_topk rows per layer per token, so a 1M-token cache can stay in host RAM while a
small hot buffer on the attention's device serves the rows in use:

    hot slots [0, window)              the most recent `window` tokens (slot = position % window)
    hot slots [window, window + lru)   rows DSA selected lately, evicted least-recently-used
    one dummy slot at the end          takes masked writes, so every step is fixed-size tensor work

slot_of[t] is token t's hot slot or -1. Before attention the selected rows that are not hot (misses)
are copied into LRU slots; attention then runs over the hot buffer with indices mapped through
slot_of, which reads the very same row values as the untiered cache: the outputs are equal.
The misses' victims come from a queue: a select's n least recently used LRU slots (n: the fetch's selections), taken
in its order by the fetches after it, skipping those used since; a fresh select only when fewer than a fetch's misses
are left (a decode step at 4K with one miss no longer pays the select over the slots' ages each step).
While LRU slots were never used, a decode step's write moves the row that leaves the window at the next write into
one (keep_next_leaving): within a context the hot buffer holds, a decode step's fetch misses only rows that left the
window during the prompt.
On a CUDA device the misses are read straight from pinned host memory by a Triton gather (zero-copy,
kernels/gather_rows.py), and a decode step's write and fetch (one token) take one kernel each
(kernels/hot_rows.py); the torch code here serves several tokens at once, and the CPU, where both tiers are host
tensors.
"""

import torch

from ..errors import Glm5Error
from ..kernels import hot_rows, topk_triton
from ..kernels.gather_rows import gather_rows
from ..kernels.hot_rows import OLDEST


class TieredLatent:
    def __init__(self, max_seq_len: int, width: int, dtype: torch.dtype, device: torch.device, hot_rows: int,
                 window: int):
        """width: one row's elements of dtype (576 bf16, or 656 uint8 for the FP8 form)."""
        if not 0 < window < hot_rows:
            raise Glm5Error(f"the hot buffer of {hot_rows} rows must hold more than the window of {window} tokens")
        self.device, self.window, self.lru = device, window, hot_rows - window
        self.host = torch.empty(max_seq_len, width, dtype=dtype, pin_memory=device.type == "cuda")
        self.hot = torch.empty(hot_rows + 1, width, dtype=dtype, device=device)  # + the dummy slot
        # int32: 4 bytes per token and layer on the device (at 1M tokens x 78 layers, 312 MiB)
        self.slot_of = torch.full((max_seq_len + 1,), -1, dtype=torch.int32, device=device)  # [-1]: dummy token
        self.token_of = torch.full((self.lru + 1,), -1, dtype=torch.long, device=device)  # LRU slot -> token
        self.stamp = torch.zeros(self.lru + 1, dtype=torch.long, device=device)  # LRU slot -> last step used
        self.step = torch.zeros((), dtype=torch.long, device=device)  # fetches so far: the LRU clock
        self.end = 0  # tokens written, or being written by the pass under way (KVCache.begin_pass)
        self.hits = torch.zeros((), dtype=torch.long, device=device)  # selected rows found hot / fetched
        self.misses = torch.zeros((), dtype=torch.long, device=device)
        # LRU slots never used since the reset: while K of them are left they are a fetch's K least recent
        self.unused = torch.full((), self.lru, dtype=torch.long, device=device)
        # the victims' queue: queue[head:end] the least recent slots at fetch queued_at, not yet taken ([lru]: spare)
        self.queue = torch.full((self.lru + 1,), self.lru, dtype=torch.int32, device=device)
        self.queue_head, self.queue_end, self.queued_at = (torch.zeros((), dtype=torch.long, device=device)
                                                           for _ in range(3))
        self.free_from = torch.zeros((), dtype=torch.long, device=device)  # LRU slots below it all hold a row

    def row_bytes(self) -> int:
        return self.host.shape[1] * self.host.element_size()

    def reset(self, end: int):
        """The cache was rewound to `end` tokens (a chat's next turn keeping a common prefix, a pass given up): the
        LRU rows of tokens before the new window stay hot (their host rows are unchanged), the others' slots are
        freed as never used; the window is refilled from host."""
        begin = max(0, end - self.window)
        leaving = self.token_of[: self.lru] >= begin  # in the new window, or past the end
        self.token_of[: self.lru].masked_fill_(leaving, -1)
        self.stamp[: self.lru].masked_fill_(leaving, 0)
        self.unused += leaving.sum()
        self.queue_end.zero_()  # the freed slots are the least recent now
        self.free_from.zero_()
        self.slot_of[begin:].fill_(-1)  # (window slots hold no token before begin: they held the last ones written)
        positions = torch.arange(begin, end, device=self.device)
        self.hot[positions % self.window] = self.host[begin:end].to(self.device, non_blocking=True)
        self.slot_of[positions] = (positions % self.window).int()
        self.end = end

    def forget(self, end: int):
        """The host rows were replaced (a saved context loaded into this cache): nothing stays hot but the window of
        the `end` tokens now held."""
        self.token_of[: self.lru].fill_(-1)
        self.stamp.zero_()
        self.unused.fill_(self.lru)
        self.slot_of.fill_(-1)
        self.reset(end)

    def write(self, positions: torch.Tensor, rows: torch.Tensor):
        """Rows [S, width] of the consecutive tokens at positions [S] (on the device): to the host tier (written
        from the GPU straight into pinned memory), and the last `window` to the hot one. Tensor work only, no
        host-side position: a CUDA graph can replay it."""
        if rows.shape[0] == 1 and one_token_kernels(self.device):
            hot_rows.write_one(rows, positions, self.host, self.hot, self.slot_of, self.token_of, self.stamp, self.step,
                               self.unused, self.free_from, self.window)
            return
        S, W = rows.shape[0], self.window
        gather_rows(rows, torch.arange(S, device=self.device), self.host, positions)
        leaving = positions - W  # these tokens leave the window (unless since moved to an LRU slot)
        slot = self.slot_of[torch.where(leaving >= 0, leaving, -1)]  # -1: the dummy token, slot -1
        self.slot_of.index_fill_(0, torch.where((slot >= 0) & (slot < W), leaving, -1), -1)
        kept = positions > positions[-1] - W  # the chunk's last W rows stay hot
        self.hot[torch.where(kept, positions % W, self.hot.shape[0] - 1)] = rows  # the rest into the dummy slot
        self.slot_of[torch.where(kept, positions, -1)] = torch.where(kept, positions % W, -1).int()
        self.slot_of[-1:].fill_(-1)  # (scalars are written by kernels: a CUDA graph may capture this)
        if rows.shape[0] == 1:
            self.keep_next_leaving(positions)

    def keep_next_leaving(self, position: torch.Tensor):
        """A decode step's write (of the token at position [1]): the token that leaves the window at the next write
        moves into the lowest never-used LRU slot while one is left, stamped as of the last fetch, so that within a
        context the hot buffer holds no row leaves it (a fetch after that write, or before it as IndexShare's
        prefetch, finds it hot). Its window slot keeps it until then. No eviction: once every LRU slot is used, the
        rows leave the window as before."""
        W, lru = self.window, self.lru
        token = position - (W - 1)
        slot = self.slot_of[torch.where(token >= 0, token, -1)]  # -1: the dummy token's
        free = torch.where(self.token_of[:lru] < 0, torch.arange(lru, device=self.device), lru).min()
        move = (slot >= 0) & (slot < W) & (free < lru)
        lru_slot = torch.where(move, free, lru)  # lru: the dummy slot
        self.hot[lru_slot + W] = self.hot[torch.where(move, slot, W + lru)]
        self.token_of[lru_slot] = torch.where(move, token, -1)
        self.stamp[lru_slot] = self.step
        self.slot_of[torch.where(move, token, -1)] = torch.where(move, lru_slot + W, -1).int()
        self.unused -= move.sum()
        self.free_from.copy_(torch.where(move, lru_slot + 1, self.free_from)[0])

    def fetch(self, indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Make the rows of indices [S, K] (-1 = none), the selections of the queries at positions [S] (consecutive,
        on the device), hot: those before the queries' own rows, which the window holds. Window rows of tokens that
        leave the window before attention reads them (< positions[-1] + 1 - window) count as misses. Needs lru >=
        2 S K, and each row's positions distinct (a top-k's). Returns the hot slot of each selection [S, K] (int32,
        -1 = none) as attention reads it, after the queries' own rows are written (before or after this fetch: their
        window slots)."""
        if indices.shape[0] == 1 and indices.shape[1] <= hot_rows.MAX_SELECTIONS and one_token_kernels(self.device):
            src, dst, mapped = hot_rows.fetch_one(indices[0].contiguous(), positions, self.slot_of, self.token_of,
                                                  self.stamp, self.step, self.hits, self.misses, self.unused,
                                                  self.queue, self.queue_head, self.queue_end, self.queued_at,
                                                  self.window)
            gather_rows(self.host, src, self.hot, dst)
            return mapped[None]
        below, window_from = positions[0], positions[-1] + 1 - self.window
        t = indices.flatten()
        t = torch.where((t >= 0) & (t < below), t, -1)
        if indices.shape[0] > 1:  # rows of several queries share tokens: each token once (one row needs no sort)
            t = t.sort().values
            t[1:].masked_fill_(t[1:] == t[:-1], -1)
        valid = t >= 0
        slot = self.slot_of[t]  # t = -1 reads the dummy token's -1
        hit = valid & (slot >= 0) & ((slot >= self.window) | (t >= window_from))
        miss = valid & ~hit
        self.step += 1
        self.stamp[torch.where(hit & (slot >= self.window), slot - self.window, self.lru)] = self.step
        victims = self.next_victims(miss.sum(), t.numel())
        lru_slot = torch.where(miss, victims[(miss.cumsum(0) - 1).clamp(min=0)], self.lru)
        evicted = self.token_of[lru_slot]
        self.unused -= (miss & (evicted < 0)).sum()
        self.slot_of.index_fill_(0, evicted, -1)  # evicted = -1 for the dummy slot: the dummy token stays -1
        self.slot_of[torch.where(miss, t, -1)] = (lru_slot + self.window).int()
        self.slot_of[-1:].fill_(-1)
        self.token_of[lru_slot] = t
        self.token_of[-1:].fill_(-1)
        self.stamp[lru_slot] = self.step
        gather_rows(self.host, torch.where(miss, t, -1), self.hot, lru_slot + self.window)
        self.hits += hit.sum()
        self.misses += miss.sum()
        return torch.where(indices >= below, indices % self.window, self.slot_of[indices]).int()

    def next_victims(self, misses: torch.Tensor, n: int) -> torch.Tensor:
        """LRU slots [n], the first `misses` (0-d) of them a fetch's victims (its n selections' hits already
        stamped): the queue's next n entries not used since they were queued, those first, or where fewer than
        `misses` are, a fresh select of the n least recent, which becomes the queue. The taken leave it. Tensor work,
        no host-side value (kernels/hot_rows.py's decode fetch does the same in its program)."""
        i = torch.arange(n, device=self.device)
        at = self.queue_head + i
        queued = self.queue[at.clamp(max=self.lru)].long()
        usable = (at < self.queue_end) & (self.stamp[queued] < self.queued_at)
        refill = usable.sum() < misses
        fresh = least_recent(self.stamp[: self.lru], self.step, n)
        queued, usable = torch.where(refill, fresh, queued), usable | refill
        rank = usable.cumsum(0) - 1
        victims = torch.full((n + 1,), self.lru, dtype=torch.long, device=self.device)
        victims[torch.where(usable, rank, n)] = queued  # the usable in order ([n]: the rest)
        taken = torch.where(usable & (rank < misses), i + 1, 0).max()
        self.queue[:n] = torch.where(refill, fresh, self.queue[:n].long()).int()
        self.queue_head.copy_(torch.where(refill, 0, self.queue_head) + taken)
        self.queue_end.copy_(torch.where(refill, n, self.queue_end))
        self.queued_at.copy_(torch.where(refill, self.step, self.queued_at))
        return victims[:n]

    def fits_fetch(self, indices: torch.Tensor) -> bool:
        """Whether the queries of indices [S, K] can read the hot buffer: their misses fit the LRU part twice over, and
        their own rows are hot (S within the window: a longer chunk reads rows of its own that only the host has)."""
        return 2 * indices.numel() <= self.lru and indices.shape[0] <= self.window


def one_token_kernels(device: torch.device) -> bool:
    """Whether a decode step's write and fetch take kernels/hot_rows.py's kernels (on a GPU)."""
    return device.type == "cuda"


def least_recent(stamp: torch.Tensor, step: torch.Tensor, n: int) -> torch.Tensor:
    """The n slots of stamp [lru] (the fetch that last used each) used least recently, by age (step - stamp, ages
    past OLDEST all alike), in topk_triton.topk_indices' order: the slots older than the n-th oldest ascending, then
    those as old ascending (as kernels/hot_rows.py's decode fetch takes them). On a GPU by the radix select (torch.topk
    sorts: 120 us for 2048 of 12K slots on the H200, bench/RESULTS.md). The rows this fetch uses have age 0 and the
    others >= 1, so they are never chosen while lru >= 2n."""
    age = (step - stamp).clamp(max=OLDEST)
    if stamp.is_cuda:
        return topk_triton.topk_indices(age.float()[None], n)[0]  # fp32 holds ages up to OLDEST exactly
    kth = age.topk(n).values[-1]
    older = (age > kth).nonzero().flatten()
    return torch.cat([older, (age == kth).nonzero().flatten()[: n - older.numel()]])
