"""bench/profile_decode.py's reading of a trace: each MoE layer's hand-off (from the host's signal to the experts'
inputs on the host, the GPU's busy time in that span as the union of its kernels, the host's waking), on a made-up
trace of two steps of two MoE layers, one kernel on a side stream."""

import sys
from pathlib import Path
from types import SimpleNamespace

from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import profile_decode  # noqa: E402


def event(name, start, end, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, thread=7)


STAGE, TO_HOST = "_stage_kernel", "Memcpy DtoH (Device -> Pinned)"  # the experts' inputs by kernel, or by copies
TRACE = [  # us; the host's waits for the experts' inputs are cudaEventSynchronize calls
    event("attention", 0, 50), event(TO_HOST, 52, 54), event("shared expert", 55, 60),
    event("cudaEventSynchronize", 10, 57, DeviceType.CPU),
    event("_wait_kernel", 56, 300),  # the second MoE layer after the first one's experts
    event("norm", 302, 310), event("side", 305, 320), event("attention", 325, 400), event(STAGE, 401, 403),
    event("shared expert", 404, 410), event("cudaEventSynchronize", 320, 408, DeviceType.CPU),
    event("_wait_kernel", 405, 700),  # the step's end: head, sampling, the next token's first MoE layer
    event("lm_head", 701, 750), event("Memcpy DtoH (Device -> Pageable)", 751, 752), event("attention", 800, 850),
    event(TO_HOST, 851, 853), event("cudaEventSynchronize", 760, 855, DeviceType.CPU),
    event("_wait_kernel", 854, 1000),
]


def test_busy_time_is_the_union_of_overlapping_kernels():
    assert profile_decode.busy_us([event("a", 0, 10), event("b", 5, 20), event("c", 30, 31)]) == 21
    assert profile_decode.busy_us([]) == 0


def test_each_moe_layer_after_a_signal_is_timed_to_its_inputs_on_the_host():
    layers = profile_decode.hand_offs(SimpleNamespace(events=lambda: TRACE))
    (after,), (first,) = layers["after a MoE layer"], layers["first of a step"]
    span, busy, count, wake, wait, piece, start = after
    assert (span, busy, count, wake, wait, start) == (103, 95, 4, 5, 244, 300)  # 300 -> 403; 302-320, 325-400, 401-403
    assert [e.name for e in piece] == ["norm", "side", "attention", STAGE]
    assert first[:5] == (153, 102, 4, 2, 295)  # 700 -> 853: the head, the sampling's copy, the first layer's work


def test_the_printed_table_has_each_kind_of_layer_and_the_last_piece_kernel_by_kernel(capsys):
    profile_decode.print_hand_offs(SimpleNamespace(events=lambda: TRACE))
    lines = capsys.readouterr().out.splitlines()
    assert "| after a MoE layer | 1 | 103.0 | 95.0 | 4 | 8.0 | 5.0 | 244.0 (244.0) |" in lines
    assert "| first of a step | 1 | 153.0 | 102.0 | 4 | 51.0 | 2.0 | 295.0 (295.0) |" in lines
    listed = lines[lines.index("the last MoE layer after another, from the host's signal: us from it, us long, stream, "
                               "kernel or copy") + 1:]
    assert [line.split()[:3] for line in listed] == [["2.0", "8.0", "7"], ["5.0", "15.0", "7"],
                                                     ["25.0", "75.0", "7"], ["101.0", "2.0", "7"]]
    assert [line.split(maxsplit=3)[3] for line in listed] == ["norm", "side", "attention", STAGE]
