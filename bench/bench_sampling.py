"""A sampled token's cost: engine.sample on GLM-5's vocabulary (154,880 logits) where the logits are (a GPU's
multinomial, what the engine does) against the draw on the CPU (sample() with a host generator: the filters where the
logits are, their probabilities copied to the host for torch's CPU multinomial, as the engine drew before session 42).

    PYTHONPATH=. python3 bench/bench_sampling.py [--vocab 154880] [--device cuda] [--tokens 200]

Prints ms a token for greedy, temperature 1, and temperature 1 with top-p 0.95 (chat's and serve's default), each as
a multiple of greedy's (argmax and one wait for the host: the floor of any draw) and against the host's draw.
"""

import argparse
import time

import torch

from glm5_offload.errors import Glm5Error
from glm5_offload.rules import check_device
from glm5_offload.runtime.engine import SamplingParams, sample


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1")
    return value


def device_name(text: str) -> torch.device:
    """--device's value, as a rule file's device is checked (rules.check_device: cpu, cuda or cuda:N)."""
    try:
        return torch.device(check_device("--device", text))
    except Glm5Error as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ")) from None


def ms_a_token(draw, logits, params, generator, tokens) -> float:
    draw(logits, params, generator)
    t0 = time.perf_counter()
    for _ in range(tokens):
        draw(logits, params, generator)
    return (time.perf_counter() - t0) / tokens * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=positive, default=154880)
    parser.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=positive, default=200)
    args = parser.parse_args(argv)
    device = args.device
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA GPU here")
    logits = torch.randn(args.vocab, device=device) * 4
    print(f"| sampling ({args.vocab} logits on {args.device}) | draw on the logits' device ms | x greedy (the floor: "
          "argmax and one wait) | draw on the CPU ms | CPU / device |\n| --- | --- | --- | --- | --- |")
    greedy = None
    for name, params in [("greedy", SamplingParams()), ("temperature 1", SamplingParams(temperature=1.0)),
                         ("temperature 1, top-p 0.95", SamplingParams(temperature=1.0, top_p=0.95))]:
        here = ms_a_token(sample, logits, params, torch.Generator(device).manual_seed(0), args.tokens)
        host = ms_a_token(sample, logits, params, torch.Generator().manual_seed(0), args.tokens)
        greedy = greedy or here
        print(f"| {name} | {here:.3f} | {here / greedy:.1f}x | {host:.3f} | {host / here:.1f}x |")


if __name__ == "__main__":
    main()
