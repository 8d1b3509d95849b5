"""kernels/host_signal.py: the GPU's wait for the host's signal, in the interpreter on the CPU (a signal given: the
wait passes and counts it, as wait_reference does) and on the GPU inside a CUDA graph (the work queued after the
wait reads what the host wrote before its signal, not before; release lets a wait go)."""

import threading
import time

import pytest
import torch

from glm5_offload.kernels import host_signal
from glm5_offload.kernels.host_signal import HostSignal


def test_a_given_signal_is_waited_for_and_counted():
    signal = HostSignal(torch.device("cpu"))
    given, waited = signal.given.clone(), signal.waited.clone()
    for _ in range(3):
        signal.give()
        given += 1
        signal.wait()
        host_signal.wait_reference(given, waited)
        assert torch.equal(signal.waited, waited) and torch.equal(signal.given, given)
    with pytest.raises(AssertionError, match="not given"):
        host_signal.wait_reference(given, waited)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_waits_for_the_host_and_reads_what_it_wrote():
    signal = HostSignal(torch.device("cuda"))
    buffer = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    signal.give()
    signal.wait()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        signal.wait()
        out.copy_(buffer, non_blocking=True)
    for step in range(1, 4):
        graph.replay()  # queued; its copy must wait for the signal

        def host(step=step):
            time.sleep(0.05)
            buffer.fill_(step)
            signal.give()
        thread = threading.Thread(target=host)
        start = time.perf_counter()
        thread.start()
        torch.cuda.synchronize()
        assert time.perf_counter() - start >= 0.04  # the GPU waited for the host
        thread.join()
        assert out.tolist() == [step] * 4
    graph.replay()  # a signal that never comes
    signal.release()  # returns: the wait let go
    assert int(signal.given[0]) == int(signal.waited[0]) == 5
