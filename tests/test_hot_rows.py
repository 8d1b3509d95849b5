"""kernels/hot_rows.py: a decode step's write and fetch of the tiered latent cache in one kernel each, against
TieredLatent's torch path (in the interpreter on the CPU; on the GPU where there is one): every table equal after
every step, over steps with hits, misses, evictions, old ties and rows leaving the window."""

import pytest
import torch

from glm5_offload.runtime import tiered_kv
from glm5_offload.runtime.tiered_kv import TieredLatent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW, LRU, WIDTH, K = 8, 48, 20, 16  # 20-byte rows: 5 words; K selections a step (2 of them -1)


def tier_pair(g: torch.Generator) -> tuple[TieredLatent, TieredLatent]:
    """Two caches in one state: 150 tokens written by a prefill, LRU stamps from long ago (ages past OLDEST: tied)
    and recent ones (distinct and tied)."""
    pair = []
    prefill = torch.randint(0, 256, (150, WIDTH), generator=g, dtype=torch.uint8)
    for _ in range(2):
        tier = TieredLatent(400, WIDTH, torch.uint8, torch.device(DEVICE), hot_rows=WINDOW + LRU, window=WINDOW)
        tier.host.fill_(3)
        tier.hot.fill_(7)
        tier.write(torch.arange(150, device=DEVICE), prefill.to(DEVICE))
        pair.append(tier)
    step = (1 << 25) + 40
    stamps = torch.cat([torch.randint(0, 1 << 24, (LRU // 2,), generator=g),
                        step - torch.randint(1, 12, (LRU - LRU // 2,), generator=g)])
    for tier in pair:
        tier.step.fill_(step)
        tier.stamp[:LRU] = stamps.to(DEVICE)
    return pair


def assert_same(a: TieredLatent, b: TieredLatent):
    assert torch.equal(a.slot_of, b.slot_of)
    assert torch.equal(a.token_of[:LRU], b.token_of[:LRU]) and torch.equal(a.stamp[:LRU], b.stamp[:LRU])
    assert int(a.step) == int(b.step) and int(a.hits) == int(b.hits) and int(a.misses) == int(b.misses)
    assert torch.equal(a.host, b.host) and torch.equal(a.hot[:-1], b.hot[:-1])  # (the last: the dummy slot)


def test_a_decode_steps_write_and_fetch_equal_the_torch_path(monkeypatch):
    g = torch.Generator().manual_seed(0)
    torch_path, kernels = tier_pair(g)
    end, last = 150, torch.arange(K - 2)
    for step in range(40):
        row = torch.randint(0, 256, (1, WIDTH), generator=g, dtype=torch.uint8).to(DEVICE)
        position = torch.tensor([end], device=DEVICE)
        # distinct picks: some of the last step's (hits), the window's rows (the oldest leaving it: misses), the
        # token itself (hot: its row was just written), others (misses: LRU victims)
        candidates = torch.cat([last[torch.randperm(len(last), generator=g)[: step % 7]],
                                torch.tensor([end - WINDOW]) if step % 3 == 0 else torch.zeros(0, dtype=torch.long),
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
        slots = kernels.slot_of[indices[indices >= 0].to(DEVICE)]  # (after both: as attention reads them)
        assert (slots >= 0).all() and torch.equal(kernels.hot[slots.long()].cpu(),
                                                     kernels.host[indices[indices >= 0]].cpu())
        end, last = end + 1, picks
    assert int(kernels.misses) > 3 * LRU and int(kernels.hits) > 40  # the LRU part was refilled several times over
