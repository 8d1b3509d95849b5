"""bench/bench_e2e.py's decode projection: a marginal layer measured below the host-bandwidth bound (the two runs'
noise) is not projected from."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import bench_e2e  # noqa: E402


def test_a_marginal_layer_below_the_bound_falls_back_to_the_whole_step():
    results = [{"context": 4096, "decode_ms_per_token": 6.0}]
    fmt, read = ("int4", 128), 100.0  # a GLM-5 layer's 8 int4 experts: 161 MB, 1.6 ms at 100 GB/s
    honest = bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 1.0, "moe_layer_ms": 3.0}])
    noise = bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 4.6, "moe_layer_ms": 1.4}])
    for row in honest:
        assert row["basis"] == "marginal" and row["projected_ms_per_token"] == 1.0 + 75 * 3.0  # 75 MoE layers
        assert 0 < row["of_bound"] < 1
    for row in noise:
        assert row["basis"].startswith("whole step") and row["projected_ms_per_token"] == 6.0 * 75
