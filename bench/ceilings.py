"""Hardware ceilings measured in the same run as the benchmarks that quote them."""

import torch

from glm5_offload.benchmark import bus_read_gb_s


def time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() on the current CUDA device, timed with events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the GPU's time without Python's launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, iters=iters)


def stream_ms(fns, rounds: int = 2, iters: int = 10) -> float:
    """Milliseconds per call when the calls fns (each on its own weights) run back to back from one CUDA graph,
    `rounds` times over: how a decode step runs its layers' projections (no graph launch per call, and with enough
    distinct weights none of them is still in L2 when it is read again)."""
    def all_calls():
        for _ in range(rounds):
            for fn in fns:
                fn()
    return graph_ms(all_calls, iters=iters) / (rounds * len(fns))


def hbm_copy_gb_s(n_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / ms / 1e6


def pinned_h2d_gb_s(n_bytes: int = 1 << 30) -> float:
    """The copy engine's speed from pinned host memory to the GPU: the GPU's read of host memory over its bus."""
    return bus_read_gb_s(torch.device("cuda"), n_bytes)


def bf16_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9
