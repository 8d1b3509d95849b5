"""Run the GPU tests and every benchmark on a CUDA machine in one go, then print a short table.

From the checkout, with no install step:  PYTHONPATH=. python3 bench/run_gpu.py [--out DIR]
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

import torch

import bench_dsa
import bench_experts
import bench_reference
import ceilings
from glm5_offload.engine import Engine
from glm5_offload.loader import load_model
from glm5_offload.tiny import make_tiny


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    results["gpu_tests"] = run_gpu_tests(out)
    print("gpu tests:", results["gpu_tests"], flush=True)
    results["hbm_copy_gb_s"] = ceilings.hbm_copy_gb_s()
    results["bf16_matmul_tflops"] = ceilings.bf16_matmul_tflops()
    print(f"ceilings: HBM copy {results['hbm_copy_gb_s']:.0f} GB/s, bf16 matmul {results['bf16_matmul_tflops']:.0f} TFLOP/s",
          flush=True)

    results["reference_layer"] = []
    for context in (4096, 32768):
        r = bench_reference.bench_layer(context)
        r["decode_gb_s"] = r["decode_bytes"] / r["decode_ms"] / 1e6
        r["decode_frac_of_hbm"] = r["decode_gb_s"] / results["hbm_copy_gb_s"]
        results["reference_layer"].append(r)
        print("reference layer:", r, flush=True)
        torch.cuda.empty_cache()

    results["tiny_decode_tok_s"] = {"cuda": tiny_decode_tok_s("cuda"), "cpu": tiny_decode_tok_s("cpu")}
    print("\nDSA kernels:", flush=True)
    results["dsa"] = bench_dsa.main()
    print("\nCPU experts on this host:", flush=True)
    results["experts"] = bench_experts.main(["--json", str(out / "experts.json")])
    results["seconds"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2))

    print("\n| figure | value |\n| --- | --- |")
    print(f"| device | {results['device']}, torch {results['torch']} |")
    print(f"| GPU tests | {results['gpu_tests']} |")
    print(f"| HBM copy (read+write) | {results['hbm_copy_gb_s']:.0f} GB/s |")
    print(f"| bf16 matmul 8192^3 | {results['bf16_matmul_tflops']:.0f} TFLOP/s |")
    for r in results["reference_layer"]:
        print(f"| reference GLM-5 MoE layer, decode @ {r['context']} | {r['decode_ms']:.2f} ms "
              f"({r['decode_gb_s']:.0f} GB/s = {r['decode_frac_of_hbm']:.1%} of HBM copy) |")
        print(f"| reference GLM-5 MoE layer, 512-token prefill @ {r['context']} | {r['prefill_tok_s']:.0f} tok/s |")
    tiny = results["tiny_decode_tok_s"]
    print(f"| tiny model decode, reference path | cuda {tiny['cuda']:.0f} tok/s, cpu {tiny['cpu']:.0f} tok/s |")
    print(f"| wall time | {results['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
