"""What int8 activations cost the routed experts, layer by layer, at GLM-5's dims (issue 18's question before they
could become the default): one MoE layer's output over many random inputs, with bf16-drawn weights quantised to
int4 (and int8) in groups of 128, computed by the numba kernels with fp32 activations and with int8 ones, against
the fp32 product of the unquantised weights. Inputs: Gaussian, with 1% outlier channels (x20), and heavy-tailed
(Student t, 3 degrees of freedom), as activations after a norm can be. Prints the relative errors (the norm of the
difference over the reference's) as median / max over the inputs, and the speed of each on this machine.

    PYTHONPATH=. python3 bench/bench_activations.py [--experts 16] [--inputs 64] [--json FILE]
"""

import argparse
import json
import time

import numpy as np
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels import moe_cpu

HIDDEN, INTER, TOP_K, GROUP = 6144, 2048, 8, 128


def inputs(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "gaussian":
        return rng.standard_normal((n, HIDDEN), np.float32)
    if kind == "outliers":
        x = rng.standard_normal((n, HIDDEN), np.float32)
        x[:, rng.choice(HIDDEN, HIDDEN // 100, replace=False)] *= 20
        return x
    return rng.standard_t(3, (n, HIDDEN)).astype(np.float32)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * INTER, HIDDEN) * HIDDEN**-0.5).bfloat16().float()
    w2 = (torch.randn(args.experts, HIDDEN, INTER) * INTER**-0.5).bfloat16().float()
    packed = {fmt: (*int_groups.quantize(w13, fmt, GROUP), *int_groups.quantize(w2, fmt, GROUP))
              for fmt in ("int4", "int8")}
    rng = np.random.default_rng(0)
    result = {"experts": args.experts, "inputs": args.inputs, "group": GROUP, "rows": []}
    for kind in ("gaussian", "outliers", "student-t3"):
        xs = inputs(kind, args.inputs, rng)
        errors = {}
        for i, x in enumerate(xs):
            ids = rng.permutation(args.experts)[:TOP_K][None]
            w = rng.random((1, TOP_K), np.float32)
            w /= w.sum()
            want = moe_cpu.moe_reference(torch.from_numpy(x[None]), w13, w2, torch.from_numpy(ids),
                                         torch.from_numpy(w)).numpy()
            for fmt, layer in packed.items():
                fp32 = moe_cpu.moe_forward(fmt, GROUP, *layer, x[None], ids, w)
                int8 = moe_cpu.moe_forward(fmt, GROUP, *layer, x[None], ids, w, act_int8=True)
                for name, value in ((f"{fmt} weights", rel(fp32, want)), (f"{fmt} + int8 act", rel(int8, want)),
                                    (f"{fmt}: int8 act vs fp32 act", rel(int8, fp32))):
                    errors.setdefault(name, []).append(value)
        for name, values in errors.items():
            result["rows"].append({"inputs": kind, "error": name, "median": float(np.median(values)),
                                   "max": float(np.max(values))})
    x = rng.standard_normal((1, HIDDEN), np.float32)
    ids, w = np.arange(TOP_K)[None] % args.experts, np.full((1, TOP_K), 1 / TOP_K, np.float32)
    for fmt, layer in packed.items():
        for act_int8 in (False, True):
            moe_cpu.moe_forward(fmt, GROUP, *layer, x, ids, w, act_int8=act_int8)
            t0 = time.perf_counter()
            for _ in range(5):
                moe_cpu.moe_forward(fmt, GROUP, *layer, x, ids, w, act_int8=act_int8)
            result[f"{fmt}{' + int8 act' if act_int8 else ''} decode ms"] = (time.perf_counter() - t0) / 5 * 1e3
    print("| inputs | relative error of the layer's output | median | max |\n| --- | --- | --- | --- |")
    for r in result["rows"]:
        print(f"| {r['inputs']} | {r['error']} | {r['median']:.2e} | {r['max']:.2e} |")
    print("decode on this machine (the same 8 experts, warm):",
          ", ".join(f"{k.removesuffix(' decode ms')} {v:.1f} ms" for k, v in result.items() if k.endswith("ms")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
