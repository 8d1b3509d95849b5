"""The tiered latent cache: host rows + a hot buffer give exactly the untiered outputs (both tiers in host
memory on the CPU; the hot one on the GPU with the `gpu` marker)."""

import pytest
import torch

from glm5_offload.errors import Glm5Error
from glm5_offload.formats.kv_rows import FP8Keys
from glm5_offload.kernels.gather_rows import gather_rows_triton
from glm5_offload.loader import load_model
from glm5_offload.ops.reference import hot_buffer_bytes
from glm5_offload.rules import load_rules
from glm5_offload.runtime import tiered_kv
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.kv_cache import new_cache
from glm5_offload.runtime.saved_context import load_context, save_context
from glm5_offload.runtime.tiered_kv import TieredLatent, least_recent

from conftest import build_hf_model, refused_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_gather_kernel_matches_indexing():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(50, 12, generator=g).bfloat16()  # 24 B rows = 6 words
    dst = torch.full((20, 12), float("nan")).bfloat16().to(DEVICE)
    src_rows = torch.tensor([3, -1, 49, 0, 17, -1])
    dst_rows = torch.tensor([5, 19, 0, 11, 7, 19])
    if DEVICE == "cuda":
        src = src.pin_memory()  # read by the kernel straight from host memory
    gather_rows_triton(src, src_rows.to(DEVICE), dst, dst_rows.to(DEVICE))
    want = torch.full((20, 12), float("nan")).bfloat16()
    want[[5, 0, 11, 7]] = src.cpu()[[3, 49, 0, 17]]
    assert torch.equal(dst.cpu().isnan(), want.isnan())
    assert torch.equal(dst.cpu()[~want.isnan()], want[~want.isnan()])


def check_resident(tier: TieredLatent, tokens: torch.Tensor):
    """Every selected token is hot with its exact host row; the slot map and the LRU table agree."""
    slots = tier.slot_of[tokens]
    assert (slots >= 0).all()
    assert torch.equal(tier.hot[slots].cpu(), tier.host[tokens.cpu()])
    in_lru = (tier.slot_of[:-1] >= tier.window).nonzero().flatten()
    assert torch.equal(tier.token_of[tier.slot_of[in_lru] - tier.window], in_lru)
    assert len(in_lru) <= tier.lru


def test_fetch_keeps_selected_rows_hot_and_exact():
    g = torch.Generator().manual_seed(1)
    tier = TieredLatent(600, 8, torch.float32, torch.device(DEVICE), hot_rows=72, window=8)
    tier.write(torch.arange(300, device=DEVICE), torch.randn(300, 8, generator=g).to(DEVICE))  # only the last 8 hot
    assert torch.equal(tier.slot_of[:300].cpu() >= 0, torch.arange(300) >= 292)
    end, selected, last = 300, 0, None
    for step in range(60):
        row = torch.randn(1, 8, generator=g)
        tier.write(torch.tensor([end], device=DEVICE), row.to(DEVICE))
        assert torch.equal(tier.host[end], row[0])  # written through to the host tier
        end += 1
        picks = torch.randperm(end, generator=g)[:16]
        if step % 3:  # the same rows again (as DSA's selections mostly are): they must be hits
            fresh = picks[~torch.isin(picks, last[:12])]  # distinct, as a top-k's row is
            picks = torch.cat([last[:12], fresh[:4]])
        indices = torch.cat([picks, torch.tensor([-1, -1])])[None].to(DEVICE)
        tier.fetch(indices, torch.tensor([end - 1], device=DEVICE))  # the newest token (end - 1) is in the window
        check_resident(tier, picks.to(DEVICE))
        selected += len(set(picks.tolist()) - {end - 1})
        last = picks
    hits, misses = int(tier.hits), int(tier.misses)
    assert hits + misses == selected and hits > selected // 3 and misses > 0

    # the cache rewound (a new prompt shares only a prefix): the LRU rows before the new window stay hot, the window
    # is refilled from the host rows, the other LRU slots are free (never used, for the fetch's shortcut)
    in_lru = tier.token_of[: tier.lru].cpu()
    kept = in_lru[(in_lru >= 0) & (in_lru < 192)]
    assert 0 < kept.numel() < (in_lru >= 0).sum()  # (the test's point: some stay, some go)
    tier.reset(200)
    tokens = torch.arange(400)
    window = (tokens >= 192) & (tokens < 200)
    assert torch.equal(tier.slot_of[:400].cpu() >= 0, window | torch.isin(tokens, kept))
    check_resident(tier, torch.cat([kept, tokens[window]]).to(DEVICE))
    assert int(tier.unused) == (tier.token_of[: tier.lru] < 0).sum() == tier.lru - kept.numel()
    assert (tier.stamp[: tier.lru][tier.token_of[: tier.lru] < 0] == 0).all()
    tier.write(torch.arange(200, 203, device=DEVICE), torch.randn(3, 8, generator=g).to(DEVICE))
    window = (tokens >= 195) & (tokens < 203)
    assert torch.equal(tier.slot_of[:400].cpu() >= 0, window | torch.isin(tokens, kept))
    hits = int(tier.hits)
    picks = torch.tensor([0, 150, 199, 201, *kept[:3].tolist()]).unique().to(DEVICE)
    tier.fetch(picks[None], torch.tensor([202], device=DEVICE))
    check_resident(tier, picks)
    assert int(tier.hits) - hits == torch.isin(picks.cpu(), torch.cat([kept, tokens[window]])).sum()

    # its host rows replaced (a saved context loaded into it): only the window of what it now holds is hot
    tier.host[:150] = torch.randn(150, 8, generator=g)
    tier.forget(150)
    assert torch.equal(tier.slot_of[:400].cpu() >= 0, (tokens >= 142) & (tokens < 150))
    assert int(tier.unused) == tier.lru and (tier.token_of[: tier.lru] < 0).all() and (tier.stamp == 0).all()
    check_resident(tier, torch.arange(142, 150, device=DEVICE))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch path", "kernels"])
def test_a_decode_steps_write_keeps_the_rows_leaving_the_window_hot_while_slots_are_free(monkeypatch, kernels):
    """Each decode step's write moves the token that leaves the window at the next write into a never-used LRU
    slot: a context the hot buffer holds loses no row, so a step's fetch of rows that left the window during decode
    misses none (before, each was a miss), after its write or before it (IndexShare's prefetch). Once every LRU slot
    is used the rows leave as before, and no write evicts one. (kernels: kernels/hot_rows.py's, in the interpreter
    on the CPU.)"""
    monkeypatch.setattr(tiered_kv, "one_token_kernels", lambda device: kernels)
    g = torch.Generator().manual_seed(4)
    W, lru = 8, 24
    tier = TieredLatent(400, 8, torch.float32, torch.device(DEVICE), hot_rows=W + lru, window=W)
    tier.write(torch.arange(100, device=DEVICE), torch.randn(100, 8, generator=g).to(DEVICE))  # rows 0-91 cold
    end = 100
    while int(tier.unused) > 1:
        position = torch.tensor([end], device=DEVICE)
        picks = torch.arange(93, end - W + 1)  # rows that left the window after a decode write (93: the first)
        picks = torch.cat([picks[torch.randperm(len(picks), generator=g)[:4]], torch.tensor([end - W])])
        before = int(tier.misses)
        if end % 2:
            tier.write(position, torch.randn(1, 8, generator=g).to(DEVICE))
        tier.fetch(torch.cat([picks, torch.tensor([-1])]).to(DEVICE)[None], position)  # end - W: leaving now
        if end % 2 == 0:
            tier.write(position, torch.randn(1, 8, generator=g).to(DEVICE))
        check_resident(tier, picks.to(DEVICE))
        assert int(tier.misses) == before + (end == 100), end  # 92 left the window at the prompt's write
        end += 1
    assert int(tier.unused) == 1 == (tier.token_of[:lru] < 0).sum() and int(tier.free_from) == lru - 1
    taken = tier.token_of[:lru].clone()
    assert torch.equal(taken[:-1].sort().values.cpu(), torch.arange(92, 92 + lru - 1))
    for end in range(end, end + 6):  # the last free slot taken by the first write, then no more moves
        tier.write(torch.tensor([end], device=DEVICE), torch.randn(1, 8, generator=g).to(DEVICE))
    assert int(tier.unused) == 0 and torch.equal(tier.token_of[: lru - 1], taken[: lru - 1])
    hot = torch.arange(end + 1)
    hot = (hot > end - W) | ((hot >= 92) & (hot < 92 + lru))
    assert torch.equal(tier.slot_of[: end + 1].cpu() >= 0, hot)
    tier.reset(110)  # rewound: its freed slots are searched from the first again
    assert int(tier.free_from) == 0 and int(tier.unused) == (tier.token_of[:lru] < 0).sum() > 0


def test_a_fetchs_few_misses_take_the_queued_victims():
    """Every LRU slot in use, each step one new row (a miss) beside rows kept hot: the misses take the queue of the
    last select's K least recent slots one after another, skipping one used since it was filled, and a new select
    comes only once the queue runs out (on a GPU its radix select took ~30 us a step for such a miss)."""
    g = torch.Generator().manual_seed(3)
    K, W = 8, 4
    tier = TieredLatent(400, 8, torch.float32, torch.device(DEVICE), hot_rows=W + 4 * K, window=W)
    tier.write(torch.arange(300, device=DEVICE), torch.randn(300, 8, generator=g).to(DEVICE))
    for first in range(0, 4 * K, K):  # every LRU slot used: the oldest first
        tier.fetch(torch.arange(first, first + K, device=DEVICE)[None], torch.tensor([300], device=DEVICE))
    assert int(tier.unused) == 0
    kept = torch.arange(3 * K, 3 * K + K - 1)  # the last K - 1 fetched: hits from here on
    selects, heads = [], []
    for step in range(3 * K):
        new = torch.tensor([100 + step])  # a miss each step
        if step == 2:  # a queued slot's row selected again (a hit): skipped when its turn comes (step 6)
            new = torch.tensor([5])
        picks = torch.cat([kept, new])[torch.randperm(K, generator=g)]
        before = tier.slot_of[:-1].clone()
        tier.fetch(picks.to(DEVICE)[None], torch.tensor([300], device=DEVICE))
        check_resident(tier, picks.to(DEVICE))
        evicted = ((before >= W) & (tier.slot_of[:-1] < 0)).nonzero().flatten().cpu()
        assert evicted.numel() == (0 if step == 2 else 1) and (evicted < 3 * K).all()  # the oldest rows' tokens
        selects.append(int(tier.queued_at))
        heads.append(int(tier.queue_head))
    assert 0 < selects[0] == selects[K - 1] < selects[K] == selects[2 * K - 1] < selects[2 * K]
    assert heads[:K] == [1, 2, 2, 3, 4, 5, 7, 8]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_least_recent_picks_the_oldest_slots(device):
    """The n oldest stamps' slots (the GPU's radix select over ages, torch.topk on the CPU); the slots the current
    fetch stamped (age 0) never, even with ties among the old ones and ages past fp32's exact range."""
    g = torch.Generator().manual_seed(2)
    step = torch.tensor((1 << 26) + 500)
    stamp = torch.randint(0, 400, (3000,), generator=g) + (1 << 26)  # ties: 3000 slots, 400 stamps
    stamp[torch.randperm(3000, generator=g)[:700]] = step  # used by this fetch
    stamp[:5] = 3  # older than fp32 tells apart from each other
    n = 1000
    got = least_recent(stamp.to(device), step.to(device), n).cpu()
    assert len(set(got.tolist())) == n
    assert (stamp[got] < step).all()
    assert stamp[got].max() <= stamp.sort().values[n - 1]  # as old as the n-th oldest or older
    assert set(range(5)) <= set(got.tolist())


def offload_rules(tmp_path, device, hot_budget, window, kv_dtype="auto", op="attention.reference", prefill_rows=4096):
    return layout_rules(tmp_path / f"offload-{kv_dtype}-{hot_budget}-{prefill_rows}.yaml", device, op,
                        f"{{kv_offload: true, hot_budget: {hot_budget}, window: {window}, kv_dtype: {kv_dtype}, "
                        f"prefill_rows: {prefill_rows}}}")


def plain_rules(tmp_path, device, kv_dtype="auto", op="attention.reference"):
    return layout_rules(tmp_path / f"plain-{kv_dtype}.yaml", device, op, f"{{kv_dtype: {kv_dtype}}}")


def layout_rules(path, device, op, kwargs):
    indexer = "indexer.dsa_triton" if op == "attention.dsa_triton" else "indexer.reference"
    path.write_text(f"""
- default: {{device: {device}}}
- match: {{class: Attention}}
  replace: {{op: {op}, kwargs: {kwargs}}}
- match: {{class: Indexer}}
  replace: {{op: {indexer}}}
""")
    return load_rules(path)


def run_greedy(model, prompt, steps):
    """Prefill, then greedy decode one token at a time: every step's logits."""
    cache = new_cache(model, 128)
    logits = [model(prompt.to(model.device), cache)]
    for _ in range(steps):
        token = logits[-1][-1].argmax().reshape(1)
        logits.append(model(token.to(model.device), cache))
    return torch.cat(logits).cpu(), cache


ON = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_tiered_model_equals_untiered(hf_checkpoint, tmp_path, device, kv_dtype, arch):
    """A context far larger than the hot buffer (24 rows of 48 for 100 tokens): the same logits, bit for bit,
    IndexShare's prefetched layers (GLM-5) and the prefill's staged path included."""
    path, _ = hf_checkpoint(arch)
    row = 32 + 4 + 16 * 2 if kv_dtype == "fp8" else 48 * 4  # bytes of one latent row (fp32 model)
    op = "attention.dsa_triton" if device == "cuda" else "attention.reference"
    plain = load_model(path, dtype=torch.float32, rules=plain_rules(tmp_path, device, kv_dtype, op))
    tiered = load_model(path, dtype=torch.float32, rules=offload_rules(tmp_path, device, 24 * row, 4, kv_dtype, op))
    prompt = torch.randint(4, 320, (40,), generator=torch.Generator().manual_seed(3))
    want, _ = run_greedy(plain, prompt, 60)
    got, cache = run_greedy(tiered, prompt, 60)
    assert torch.equal(got, want)
    stats = cache.offload_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["fetched_bytes"] == stats["misses"] * row
    assert cache.prefetched == {}  # every shared layer's prefetch was used
    assert isinstance(cache.index_keys[0], FP8Keys) == (kv_dtype == "fp8")  # 132 B keys go with 656 B rows


STAGED = [("auto", 5, 128)] + ([] if torch.cuda.is_available() else [("fp8", 1, 8)])  # (rows' form, layers, topk)


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("op", ["attention.reference", "attention.dsa_triton"])
@pytest.mark.parametrize("kv, layers, topk", STAGED, ids=[kv for kv, _, _ in STAGED])
def test_a_staging_buffer_smaller_than_the_context_reads_in_slabs(tmp_path, device, op, kv, layers, topk,
                                                                 monkeypatch):
    """prefill_rows 32 for a 40-token prompt chunk and a 60-token one: each chunk reads the rows so far in slabs of
    32 positions copied in turn from host memory, attention merged over them by log-sum-exp; the logits equal the
    untiered cache's up to fp32 rounding (the sums go in another order). The hot buffer (4 MiB) holds more than the
    context and the window is 4 tokens: a chunk longer than the window must not read the hot buffer (its own
    earlier rows are only in host memory: they read as missing, NaN, before fits_fetch asked for it).
    The sums' order must not reach a discrete choice of this random model, or every later logit moves with it: in
    the fp32 rows' case the indexer keeps 128 rows, more than the context, so that every query selects all of its
    rows (in score order, which the slabs sort) and no near-tied selection flips; the FP8 rows' case has one layer,
    whose rows and selections come from the embeddings alone (above it, a latent value a rounding away from an e4m3
    step is stored one step apart, and every token that reads its row moves). Which selection flipped with the seeds
    of a 5-layer, 8-row case depended on the CPU. The Triton kernels run in the interpreter on the CPU, where they
    compute in fp32; on the GPU the rows are fp32 (FP8 rows compute in bf16 there)."""
    from glm5_offload.runtime.kv_cache import KVCache

    path = tmp_path / "hf"
    build_hf_model("glm_moe_dsa", num_hidden_layers=layers, index_topk=topk,
                   index_topk_pattern="FSSSF"[:layers]).save_pretrained(path)
    plain = load_model(path, dtype=torch.float32, rules=plain_rules(tmp_path, device, kv, op))
    tiered = load_model(path, dtype=torch.float32,
                        rules=offload_rules(tmp_path, device, 4 << 20, 4, kv, op, prefill_rows=32))
    prompt = torch.randint(4, 320, (40,), generator=torch.Generator().manual_seed(7))
    more = torch.randint(4, 320, (60,), generator=torch.Generator().manual_seed(8))

    def run(model):
        cache = new_cache(model, 128)
        return torch.cat([model(prompt.to(model.device), cache), model(more.to(model.device), cache)]).cpu()

    want = run(plain)
    slabs = []
    original = KVCache.row_slabs

    def counted(self, layer, indices, positions, end):
        for rows, local, span in original(self, layer, indices, positions, end):
            assert rows.shape[0] <= 32 and local.shape == indices.shape and local.max() < rows.shape[0]
            inside = torch.arange(local.shape[1], device=local.device)
            inside = (inside >= span[:, :1]) & (inside < span[:, 1:])
            assert torch.equal(local >= 0, inside)  # the span holds exactly the slab's indices
            slabs.append((end, rows.shape[0]))
            yield rows, local, span

    monkeypatch.setattr(KVCache, "row_slabs", counted)
    torch.testing.assert_close(run(tiered), want, rtol=1e-4, atol=1e-4)
    layers = len(tiered.model.layers)
    assert sorted(slabs) == sorted([(40, 32), (40, 8)] * layers + ([(100, 32)] * 3 + [(100, 4)]) * layers)


def test_engine_rewinds_the_tiered_cache(hf_checkpoint, tmp_path):
    """Two prompts sharing a prefix: the second reuses the cached rows and still matches the untiered engine."""
    path, _ = hf_checkpoint("glm_moe_dsa")
    plain = Engine(load_model(path, dtype=torch.float32, rules=plain_rules(tmp_path, "cpu")), max_seq_len=128)
    tiered = Engine(load_model(path, dtype=torch.float32, rules=offload_rules(tmp_path, "cpu", 24 * 192, 4)),
                    max_seq_len=128)
    first = list(range(10, 50))
    second = first[:30] + list(range(100, 120))
    for engine in (plain, tiered):
        engine.stop_ids = set()
    for prompt in (first, second):
        a, b = plain.generate(prompt, 20), tiered.generate(prompt, 20)
        assert a.output_ids == b.output_ids
    assert b.reused_tokens == 30


def test_a_context_loaded_into_a_used_tiered_cache_leaves_nothing_stale_hot(hf_checkpoint, tmp_path):
    """A saved context loaded into an engine whose tiered cache holds another context's rows hot: it decodes what a
    fresh engine that loads it does (the rows the LRU part held are another context's, under the same positions)."""
    path, _ = hf_checkpoint("glm_moe_dsa")

    def engine(rules):
        e = Engine(load_model(path, dtype=torch.float32, rules=rules), max_seq_len=128)
        e.stop_ids = set()
        return e

    tiered = offload_rules(tmp_path, "cpu", 48 * 192, 4)
    saver = engine(plain_rules(tmp_path, "cpu"))
    saver.generate(list(range(60, 110)), 4)
    save_context(saver, tmp_path / "ctx.safetensors")
    used, fresh = engine(tiered), engine(tiered)
    used.generate(list(range(10, 60)), 20)  # its LRU part holds rows of these tokens' positions
    tier = used.cache.latent[0]
    assert (tier.token_of[: tier.lru] >= 0).sum() > 8
    prompt = saver.cache_ids + list(range(120, 125))
    for e in (used, fresh):
        assert load_context(e, tmp_path / "ctx.safetensors") == len(saver.cache_ids)
    assert used.generate(prompt, 12).output_ids == fresh.generate(prompt, 12).output_ids


@pytest.mark.parametrize("kwargs, message", [
    ("{kv_dtype: int3}", "kv_dtype must be 'auto'"),
    ("{kv_offload: 1}", "kv_offload must be true or false"),
    ("{hot_budget: lots}", "hot_budget: 'lots' is not a size"),
    ("{window: 0}", "window must be a positive number"),
    ("{prefill_rows: 0}", "prefill_rows must be a positive number of rows"),
])
def test_bad_layout_kwargs_name_the_rule(tmp_path, kwargs, message):
    refused_rule(tmp_path, "Attention", f"op: attention.reference, kwargs: {kwargs}", message)


def test_a_hot_buffer_too_small_is_refused(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("glm_moe_dsa")
    model = load_model(path, dtype=torch.float32, rules=offload_rules(tmp_path, "cpu", 10 * 192, 4))
    with pytest.raises(Glm5Error, match="hot_budget 1920 B holds 10 latent rows of 192 B: it needs at least window 4"):
        new_cache(model, 64)


@pytest.mark.parametrize("kv_dtype, row", [("auto", 48 * 4), ("fp8", 32 + 4 + 16 * 2)])
def test_the_plan_counts_every_device_table_of_a_tiered_layer(hf_checkpoint, tmp_path, kv_dtype, row):
    """The planner's hot-buffer bytes are what a tiered layer allocates beside the host rows and slot_of (per token,
    counted apart): its hot rows and every per-slot table, whatever tables it grows."""
    path, _ = hf_checkpoint("glm_moe_dsa")
    model = load_model(path, dtype=torch.float32, rules=offload_rules(tmp_path, "cpu", 50 * row + 7, 4, kv_dtype))
    cache = new_cache(model, 64)
    for latent, layout in zip(cache.latent, cache.layouts):
        tables = [t for name, t in vars(latent).items()
                  if isinstance(t, torch.Tensor) and t.dim() and name not in ("host", "slot_of")]
        assert latent.row_bytes() == row and sum(t.nbytes for t in tables) == hot_buffer_bytes(layout, row)
