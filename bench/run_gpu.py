"""Run the GPU tests and every benchmark on a CUDA machine in one go, then print a short table.

From the checkout, with no install step:  PYTHONPATH=.:bench python3 bench/run_gpu.py [--out DIR] [--parts ...]
Uses only torch, triton, numba and transformers as that machine has them. Full figures go to
DIR/results.json and the pytest log to DIR/gpu_tests.log.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_experts
import torch

from glm5_offload.loader import load_model
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import make_tiny

import bench_dsa
import bench_linear
import bench_reference
import bench_tiered
import ceilings


def run_gpu_tests(out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"


def tiny_decode_tok_s(device: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny(Path(tmp) / "tiny"), device=device)
    engine = Engine(model, max_seq_len=512)
    engine.stop_ids = set()
    engine.generate(list(range(12, 140)), 8)  # warm-up
    return engine.generate(list(range(12, 140)), 64).decode_tokens_per_s


PARTS = ("tests", "reference", "linear", "dsa", "experts", "tiered")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which of {', '.join(PARTS)} to run (a device call is capped at 10 minutes: all of "
                             "them take about 12; run 'tiered' in a call of its own)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    table = [("device", f"{results['device']}, torch {results['torch']}")]

    if "tests" in parts:
        results["gpu_tests"] = run_gpu_tests(out)
        table.append(("GPU tests", results["gpu_tests"]))
        print("gpu tests:", results["gpu_tests"], flush=True)
    if "reference" in parts:
        hbm = ceilings.hbm_copy_gb_s()
        results["reference_layer"] = []
        for context in (4096, 32768):
            r = bench_reference.bench_layer(context)
            r["decode_gb_s"] = r["decode_bytes"] / r["decode_ms"] / 1e6
            r["decode_frac_of_hbm"] = r["decode_gb_s"] / hbm
            results["reference_layer"].append(r)
            table.append((f"reference GLM-5 MoE layer, decode @ {context}", f"{r['decode_ms']:.2f} ms "
                          f"({r['decode_gb_s']:.0f} GB/s = {r['decode_frac_of_hbm']:.1%} of HBM copy {hbm:.0f} GB/s)"))
            table.append((f"reference GLM-5 MoE layer, 512-token prefill @ {context}", f"{r['prefill_tok_s']:.0f} tok/s"))
            torch.cuda.empty_cache()
        tiny = results["tiny_decode_tok_s"] = {"cuda": tiny_decode_tok_s("cuda"), "cpu": tiny_decode_tok_s("cpu")}
        table.append(("tiny model decode, reference path", f"cuda {tiny['cuda']:.0f} tok/s, cpu {tiny['cpu']:.0f} tok/s"))
    if "linear" in parts:
        print("\nFP8 / int4 linear kernels:", flush=True)
        results["linear"] = bench_linear.run()
        print(bench_linear.table(results["linear"]), flush=True)
    if "dsa" in parts:
        print("\nDSA kernels:", flush=True)
        results["dsa"] = bench_dsa.main()
    if "experts" in parts:
        print("\nCPU experts on this host:", flush=True)
        results["experts"] = bench_experts.main(["--json", str(out / "experts.json")])
    if "tiered" in parts:
        print("\nTiered latent cache:", flush=True)
        results["tiered"] = bench_tiered.main([])
    results["seconds"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table.append(("wall time", f"{results['seconds']:.0f} s"))
    print("\n| figure | value |\n| --- | --- |")
    for name, value in table:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
