"""Generation: greedy and seeded sampling, top-k / top-p, stop ids, streaming, and refusals."""

import pytest
import torch

from glm5_offload.errors import Glm5Error
from glm5_offload.loader import load_model
from glm5_offload.runtime.engine import Engine, SamplingParams, sample
from glm5_offload.runtime.kv_cache import new_cache

PROMPT = [12, 40, 77, 301, 5, 990, 18, 64, 64, 3, 870, 45, 12, 19, 200, 201, 202, 33, 34, 35]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(load_model(tiny_dir(), dtype=torch.float32), max_seq_len=256)


def test_greedy_is_argmax_of_the_model(engine):
    out = engine.generate(PROMPT, 8).output_ids
    model = engine.model
    logits = model(torch.tensor(PROMPT + out[:-1]), new_cache(model, 64))
    assert logits[len(PROMPT) - 1 :].argmax(-1).tolist() == out


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=1.0, seed=7)
    a = engine.generate(PROMPT, 16, params).output_ids
    assert engine.generate(PROMPT, 16, params).output_ids == a
    others = [engine.generate(PROMPT, 16, SamplingParams(temperature=1.0, seed=s)).output_ids for s in (8, 9)]
    assert any(o != a for o in others)


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate(PROMPT, 10).output_ids
    assert engine.generate(PROMPT, 10, SamplingParams(temperature=2.0, top_k=1, seed=1)).output_ids == greedy
    assert engine.generate(PROMPT, 10, SamplingParams(temperature=2.0, top_p=1e-6, seed=1)).output_ids == greedy


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sample_filters(device):
    """Drawn on the logits' device (a GPU's draw with a generator of its own), each filter's set and nothing else;
    a seed draws the same tokens again."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], device=device))
    gen = torch.Generator(device).manual_seed(0)
    draws = lambda p: {sample(logits, p, gen) for _ in range(300)}  # noqa: E731

    def seeded(logits):
        g = torch.Generator(device).manual_seed(5)
        return [sample(logits, SamplingParams(temperature=1.0), g) for _ in range(20)]

    assert seeded(logits) == seeded(logits) == seeded(logits.cpu())  # (logits elsewhere go to the generator)
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.6)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {0}
    assert draws(SamplingParams(temperature=1.0, top_p=0.81)) == {0, 1, 2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1)])
def test_logits_that_are_not_finite_are_a_model_error(bad, params):
    """A NaN anywhere (or an inf on top) in the logits: a ModelError naming it, greedy or sampled, never a token
    picked from them (argmax of NaNs was token 0) nor torch's multinomial traceback."""
    from glm5_offload.errors import ModelError

    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    assert sample(logits, params, torch.Generator().manual_seed(0)) in range(300)
    logits[123] = bad
    with pytest.raises(ModelError, match=f"logits hold {bad}"):
        sample(logits, params, torch.Generator().manual_seed(0))


def test_stops_on_eos_and_streams_every_token(engine):
    assert engine.stop_ids == set(engine.model.config.eos_token_ids) and engine.stop_ids
    full = engine.generate(PROMPT, 12).output_ids
    streamed = []
    saved = engine.stop_ids
    engine.stop_ids = {full[5]}
    try:
        result = engine.generate(PROMPT, 12, on_token=streamed.append)
    finally:
        engine.stop_ids = saved
    cut = full.index(full[5]) + 1
    assert result.output_ids == full[:cut] and result.stop_reason == "eos"
    assert streamed == result.output_ids
    assert result.prefill_tokens_per_s > 0


def test_chunked_prefill_equals_one_shot(engine):
    model = engine.model
    one = model(torch.tensor(PROMPT), new_cache(model, 64))[-1]
    chunked = Engine(model, max_seq_len=64, prefill_chunk=3)
    chunked.cache = new_cache(model, 64)
    assert torch.allclose(chunked.prefill(PROMPT), one, rtol=1e-5, atol=1e-5)
    assert chunked.cache_ids == PROMPT and chunked.cache.length == len(PROMPT)


def test_a_prompt_extending_the_last_one_prefills_only_its_new_tokens(engine):
    first = engine.generate(PROMPT, 6)
    history = PROMPT + first.output_ids
    follow = history + [50, 51, 52]
    second = engine.generate(follow, 6)
    assert second.reused_tokens == len(history) - 1  # the last reply token was never fed: it is run now
    assert second.prefilled_tokens == 4
    fresh = Engine(engine.model, max_seq_len=256)
    assert fresh.generate(follow, 6).output_ids == second.output_ids
    diverged = engine.generate(PROMPT[:5] + [7, 7, 7], 3)
    assert diverged.reused_tokens == 5


def test_the_gpu_out_of_memory_is_one_line_and_the_engine_goes_on(engine, monkeypatch):
    """torch's OutOfMemoryError in a pass (a prefill chunk too big for what the GPU has left): a ModelError of one
    line with what torch tried to allocate and what to change; the next request runs as on a fresh engine."""
    from glm5_offload.errors import ModelError

    engine.generate(PROMPT, 4)
    real = type(engine.model).forward

    def out_of_memory(model, tokens, cache, logits_for="all"):
        if tokens.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 23.65 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this "
                                         "process has 22.58 GiB memory in use. Of the allocated memory ...")
        return real(model, tokens, cache, logits_for)

    monkeypatch.setattr(type(engine.model), "forward", out_of_memory)
    with pytest.raises(ModelError) as failed:
        engine.generate(PROMPT + [9, 9, 9], 4)
    assert str(failed.value) == (
        "the GPU ran out of memory in a pass of 3 tokens (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 1.06 GiB is free); a smaller --prefill-chunk or --max-seq-len, or rules "
        "that place less on the GPU, need less (glm5 plan shows what fits)")
    monkeypatch.setattr(type(engine.model), "forward", real)
    follow = PROMPT + [9, 9, 9, 8]
    assert engine.generate(follow, 4).output_ids == Engine(engine.model, max_seq_len=256).generate(follow, 4).output_ids


def test_on_token_can_stop_the_generation(engine):
    seen = []
    result = engine.generate(PROMPT, 10, on_token=lambda t: seen.append(t) or len(seen) == 3)
    assert result.stop_reason == "stop" and result.output_ids == seen and len(seen) == 3


@pytest.mark.parametrize("prompt, n, params, match", [
    (PROMPT, 300, SamplingParams(), "exceeds max_seq_len 256"),
    ([], 4, SamplingParams(), "prompt is empty"),
    ([5, 5000], 4, SamplingParams(), "token id 5000 is outside the vocabulary"),
    (PROMPT, 4, SamplingParams(temperature=-1), "temperature"),
    (PROMPT, 4, SamplingParams(top_p=0), "top_p"),
    (PROMPT, 4, SamplingParams(top_k=-2), "top_k"),
])
def test_refusals(engine, prompt, n, params, match):
    with pytest.raises(Glm5Error, match=match):
        engine.generate(prompt, n, params)


def test_max_seq_len_above_the_model_is_refused(engine):
    with pytest.raises(Glm5Error, match="max_position_embeddings"):
        Engine(engine.model, max_seq_len=10**7)
