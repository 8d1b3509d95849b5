"""kernels/hot_rows.py: a decode step's write and fetch of the tiered latent cache in one kernel each, against
TieredLatent's torch path (in the interpreter on the CPU; on the GPU where there is one): every table equal after
every step, over steps with hits, misses, evictions, old ties and rows leaving the window."""

import pytest
import torch
import triton
import triton.language as tl

from glm5_offload.kernels import hot_rows
from glm5_offload.kernels.topk_triton import BITS, _kth_of_row, _write_top_of_row
from glm5_offload.runtime import tiered_kv
from glm5_offload.runtime.tiered_kv import TieredLatent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW, LRU, WIDTH, K = 8, 48, 20, 16  # 20-byte rows: 5 words; K selections a step (2 of them -1)


def tier_pair(g: torch.Generator, state: str) -> tuple[TieredLatent, TieredLatent]:
    """Two caches in one state: 150 tokens written by a prefill; fresh (every LRU slot unused: the first fetches'
    victims need no select), fresh long ago (K slots unused, the used ones' ages past OLDEST: tied with theirs, so the
    used come first among the victims), partly used (K - 2 slots unused: the used ones older than the K-th least
    recent come first among the victims), or aged: every LRU slot used (by tokens never selected here), stamps from
    long ago (ages past OLDEST: tied) and recent ones (distinct and tied)."""
    pair = []
    prefill = torch.randint(0, 256, (150, WIDTH), generator=g, dtype=torch.uint8)
    for _ in range(2):
        tier = TieredLatent(400, WIDTH, torch.uint8, torch.device(DEVICE), hot_rows=WINDOW + LRU, window=WINDOW)
        tier.host.fill_(3)
        tier.hot.fill_(7)
        tier.write(torch.arange(150, device=DEVICE), prefill.to(DEVICE))
        pair.append(tier)
    if state == "fresh":
        return pair
    if state == "partly used":
        used = LRU - (K - 2)
        stamps = torch.randint(1, 30, (used,), generator=g)
        for tier in pair:
            tier.step.fill_(30)
            tier.stamp[:used] = stamps.to(DEVICE)
            tier.token_of[:used] = torch.arange(250, 250 + used, device=DEVICE)
            tier.unused.fill_(K - 2)
        return pair
    step = (1 << 25) + 40
    if state == "fresh, long ago":  # K slots never used, the others used over OLDEST fetches ago: all tied as oldest
        used = LRU - K
        stamps = torch.randint(1, 1 << 24, (used,), generator=g)
        for tier in pair:
            tier.step.fill_(step)
            tier.stamp[:used] = stamps.to(DEVICE)
            tier.token_of[:used] = torch.arange(250, 250 + used, device=DEVICE)
            tier.unused.fill_(K)
        return pair
    stamps = torch.cat([torch.randint(0, 1 << 24, (LRU // 2,), generator=g),
                        step - torch.randint(1, 12, (LRU - LRU // 2,), generator=g)])
    for tier in pair:
        tier.step.fill_(step)
        tier.stamp[:LRU] = stamps.to(DEVICE)
        tier.token_of[:LRU] = torch.arange(250, 250 + LRU, device=DEVICE)
        tier.unused.zero_()
    return pair


def assert_same(a: TieredLatent, b: TieredLatent):
    assert torch.equal(a.slot_of, b.slot_of)
    assert torch.equal(a.token_of[:LRU], b.token_of[:LRU]) and torch.equal(a.stamp[:LRU], b.stamp[:LRU])
    assert int(a.step) == int(b.step) and int(a.hits) == int(b.hits) and int(a.misses) == int(b.misses)
    assert int(a.unused) == int(b.unused) == int((a.token_of[:LRU] < 0).sum())
    assert int(a.free_from) == int(b.free_from) and bool((a.token_of[: int(a.free_from)] >= 0).all())
    assert torch.equal(a.host, b.host) and torch.equal(a.hot[:-1], b.hot[:-1])  # (the last: the dummy slot)


@pytest.mark.parametrize("age_block", [hot_rows.AGE_BLOCK, 16])  # the LRU part's 48 ages in one block, or three
@pytest.mark.parametrize("state", ["aged", "fresh", "partly used", "fresh, long ago"])
def test_a_decode_steps_write_and_fetch_equal_the_torch_path(monkeypatch, age_block, state):
    monkeypatch.setattr(hot_rows, "AGE_BLOCK", age_block)
    g = torch.Generator().manual_seed(0)
    torch_path, kernels = tier_pair(g, state)
    end, last = 150, torch.arange(K - 2)
    for step in range(40):
        row = torch.randint(0, 256, (1, WIDTH), generator=g, dtype=torch.uint8).to(DEVICE)
        position = torch.tensor([end], device=DEVICE)
        # distinct picks: some of the last step's (hits), the window's rows (the oldest leaving it: misses), the
        # token itself (hot: its row was just written, or is written after the fetch), others (misses: LRU victims)
        first_fetched = torch.tensor([end - WINDOW, end]) if step % 3 == 0 else torch.zeros(0, dtype=torch.long)
        candidates = torch.cat([last[torch.randperm(len(last), generator=g)[: step % 7]], first_fetched,
                                torch.arange(end - WINDOW, end + 1)[torch.randperm(WINDOW + 1, generator=g)[:3]],
                                torch.randperm(end + 1, generator=g)]).tolist()
        picks = torch.tensor(list(dict.fromkeys(candidates))[: K - 2])
        indices = torch.cat([picks, torch.tensor([-1, -1])])[torch.randperm(K, generator=g)]
        mapped = []
        for tier, use_kernels in ((torch_path, False), (kernels, True)):
            monkeypatch.setattr(tiered_kv, "one_token_kernels", lambda device, use=use_kernels: use)
            if step % 3:
                tier.write(position, row)
            # else (as IndexShare's shared layers, whose fetch runs before their write): the window's oldest row is
            # still hot, but leaves the window before attention reads it: a miss, moved to an LRU slot the write keeps
            mapped.append(tier.fetch(indices[None].to(DEVICE), position)[0])
            if step % 3 == 0:
                tier.write(position, row)
        assert_same(torch_path, kernels)
        assert torch.equal(mapped[0], mapped[1])
        # the fetch's slots are those attention reads after both (the token's own row included, when it came first;
        # a write after the fetch may move the next token to leave the window into an LRU slot: its window slot still
        # holds it)
        slot_of = kernels.slot_of[indices.to(DEVICE)].cpu()
        if step % 3 == 0:
            slot_of = torch.where(indices == end + 1 - WINDOW, (end + 1 - WINDOW) % WINDOW, slot_of)
        assert torch.equal(mapped[1].cpu(), slot_of)
        slots = mapped[1][(indices >= 0).to(DEVICE)]
        assert (slots >= 0).all() and torch.equal(kernels.hot[slots.long()].cpu(),
                                                     kernels.host[indices[indices >= 0]].cpu())
        end, last = end + 1, picks
    assert int(kernels.misses) > 3 * LRU and int(kernels.hits) > 40  # the LRU part was refilled several times over


@triton.jit
def _victims_kernel(stamp_ptr, out_ptr, T, k, step, OLDEST: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    # the fetch's victims select alone: the k least recently used of stamp [T] -> out [k]
    kth, ties = _kth_of_row(stamp_ptr, T, k, step, OLDEST, True, BITS, BLOCK)
    _write_top_of_row(stamp_ptr, T, k, kth, ties, k, out_ptr, step, OLDEST, True, BLOCK)


def stamps_of(case: str, T: int, step: int, g: torch.Generator) -> torch.Tensor:
    stamp = step - torch.randint(1, 40, (T,), generator=g)  # recently used, many ties
    if case == "never used":  # more never-used slots (the oldest) than victims: the one-pass answer
        stamp[torch.randperm(T, generator=g)[:30]] = 0
    elif case == "few oldest first":  # fewer oldest than victims, all in the first block; smaller maxima after
        stamp[:5] = 0
    elif case == "past OLDEST":  # ages beyond OLDEST all tie
        stamp[torch.randperm(T, generator=g)[:12]] = torch.randint(0, 1 << 20, (12,), generator=g)
    return stamp


@pytest.mark.parametrize("case", ["never used", "few oldest first", "past OLDEST", "recent only"])
def test_the_victims_select_equals_least_recent(case):
    """The one-program select over ages (its one-pass answer when enough slots are of the oldest age, else the
    passes) takes least_recent's slots in its order, the ages over several blocks."""
    g = torch.Generator().manual_seed(len(case))
    T, k, step = 100, 8 if case == "few oldest first" else 20, (1 << 24) + 1000 if case == "past OLDEST" else 5000
    stamp = stamps_of(case, T, step, g)
    out = torch.full((k,), -7, dtype=torch.int64, device=DEVICE)
    _victims_kernel[(1,)](stamp.to(DEVICE), out, T, k, step, OLDEST=hot_rows.OLDEST, BITS=BITS, BLOCK=16)
    assert torch.equal(out.cpu(), tiered_kv.least_recent(stamp, torch.tensor(step), k))
