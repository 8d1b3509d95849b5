"""Generation for one sequence: chunked prefill into the latent cache, decode loop, sampling, stop ids."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..errors import Glm5Error, ModelError, out_of_memory_said
from ..model import CausalLM
from ..util import is_active, sync
from .decode_graphs import DecodeGraphs, unsupported
from .kv_cache import new_cache


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    def check(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise Glm5Error(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise Glm5Error(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise Glm5Error(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise Glm5Error(f"seed must be a 64-bit integer, got {self.seed}")


def check_prompt(prompt_ids: list[int], max_new_tokens: int, vocab: int, max_seq_len: int):
    """A prompt the engine can run: not empty, its ids in the vocabulary, room for the new tokens."""
    if not prompt_ids:
        raise Glm5Error("the prompt is empty")
    bad = [i for i in prompt_ids if not 0 <= i < vocab]
    if bad:
        raise Glm5Error(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if len(prompt_ids) + max_new_tokens > max_seq_len:
        raise Glm5Error(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds "
                        f"max_seq_len {max_seq_len}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [vocab] (fp32). Logits whose largest is not finite (NaN or inf: a weight or an
    activation of the model) are a ModelError, not a token."""
    best = logits.argmax()
    best_id, top = torch.stack([best.double(), logits[best].double()]).tolist()  # one wait for both
    if not math.isfinite(top):
        raise ModelError(f"the model's next-token logits hold {top} (not finite): a weight of the checkpoint or an "
                         "activation is NaN or overflows its dtype")
    if params.temperature == 0:
        return int(best_id)
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0))
    # drawn where the logits are (a GPU's multinomial, not the CPU's: 3.1 ms for GLM-5's 154,880 entries on CI's
    # cores, every token); a seeded generator lives on the residual stream's device (Engine.generate)
    if generator is not None and probs.device != generator.device:  # (an lm_head placed elsewhere)
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    stop_reason: str = "length"  # "eos" | "length" | "stop" (on_token asked)
    reused_tokens: int = 0  # prompt tokens whose cache rows were kept from before
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefilled_tokens(self) -> int:
        return len(self.prompt_ids) - self.reused_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first output token comes from the prefill's logits; decode steps make the rest
        steps = max(len(self.output_ids) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """One sequence's engine. Its latent cache outlives a generate() call: the next prompt that starts
    with the same tokens (a chat's next turn, a request extending the last conversation) prefills only
    what is new."""

    def __init__(self, model: CausalLM, max_seq_len: int | None = None, prefill_chunk: int = 2048,
                 cuda_graphs: bool = True):
        """cuda_graphs: decode from CUDA graphs where the placement allows it (decode_graphs.py); False: eager."""
        self.model = model
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        model.config.check_positions(self.max_seq_len)
        self.prefill_chunk = prefill_chunk
        self.stop_ids = set(model.config.eos_token_ids)
        self.cache = None
        self.graphs: DecodeGraphs | None = None
        self.use_graphs = cuda_graphs and unsupported(model) is None
        self.cache_ids: list[int] = []  # the tokens whose rows the cache holds, in order

    def reset(self):
        """Forget the cached context."""
        self.cache_ids = []
        if self.cache is not None:
            self.cache.rewind(0)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append ids to the cache; the last one's logits [vocab]."""
        try:
            if len(ids) == 1 and self.use_graphs and not is_active():
                if self.graphs is None:
                    self.graphs = DecodeGraphs(self.model, self.cache)
                logits = self.graphs.step(ids[0])
            else:
                tokens = torch.tensor(ids, dtype=torch.long, device=self.model.device)
                logits = self.model(tokens, self.cache, logits_for="last")[-1]
        except BaseException as e:  # Ctrl-C, out of memory: the cache holds what it held, or an earlier point
            self.cache.abandon_pass()
            del self.cache_ids[self.cache.length :]
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
                raise ModelError(f"the GPU ran out of memory in a pass of {len(ids)} tokens ({out_of_memory_said(e)});"
                                 " a smaller --prefill-chunk or --max-seq-len, or rules that place less on the GPU, "
                                 "need less (glm5 plan shows what fits)") from None
            raise
        self.cache_ids.extend(ids)
        return logits

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run ids through the model in chunks (a progress bar when there are several); the last logits."""
        chunks = range(0, len(ids), self.prefill_chunk)
        bar = tqdm(total=len(ids), desc="prefill", unit="tok", disable=None if len(chunks) > 1 else True, leave=False)
        for s in chunks:
            logits = self._feed(ids[s : s + self.prefill_chunk])
            bar.update(min(self.prefill_chunk, len(ids) - s))
        bar.close()
        return logits

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        on_token: Callable[[int], bool | None] | None = None,
    ) -> GenerationResult:
        """Greedy or sampled continuation of prompt_ids. on_token(id) is called for each new token;
        returning True stops the generation there (stop_reason "stop")."""
        params.check()
        check_prompt(prompt_ids, max_new_tokens, self.model.config.vocab_size, self.max_seq_len)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.model.device).manual_seed(params.seed)
        if self.cache is None:
            self.cache = new_cache(self.model, self.max_seq_len)
        # keep the cached prefix the prompt shares (at least one prompt token is run, for its logits; a model with
        # KDA layers resumes at the cache's end or at its resume point, marked before the prompt's last token)
        del self.cache_ids[self.cache.length :]
        keep = self.cache.rewind(min(common_prefix(self.cache_ids, prompt_ids), len(prompt_ids) - 1))
        del self.cache_ids[keep:]
        result = GenerationResult(prompt_ids=list(prompt_ids), reused_tokens=keep)
        device = self.model.device

        t0 = time.perf_counter()
        if self.cache.kda:
            if keep < len(prompt_ids) - 1:
                self.prefill(prompt_ids[keep:-1])
            self.cache.mark_resume_point()
            logits = self._feed(prompt_ids[-1:])
        else:
            logits = self.prefill(prompt_ids[keep:])
        sync(device)
        result.prefill_seconds = time.perf_counter() - t0

        t0 = time.perf_counter()
        for step in range(max_new_tokens):
            if step:
                logits = self._feed(result.output_ids[-1:])
            next_id = sample(logits, params, generator)
            result.output_ids.append(next_id)
            if on_token is not None and on_token(next_id):
                result.stop_reason = "stop"
                break
            if next_id in self.stop_ids:
                result.stop_reason = "eos"
                break
        sync(device)
        result.decode_seconds = time.perf_counter() - t0
        return result
