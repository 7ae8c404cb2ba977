"""engine/capture.py without a GPU: the order of its calls into torch.cuda (a stream of its own,
the cached cuBLAS workspaces freed before the first capture, one pool, failed captures kept until
close). The GPU test that the graphs survive what the process does to those workspaces is
tests/gpu/test_engine_gpu.py::test_graphs_keep_their_cublas_workspace_when_the_process_frees_others."""
import contextlib

import pytest
import torch

from opmap.engine import capture as C


class FakeGraph:
    made = []

    def __init__(self):
        self.resets = 0
        FakeGraph.made.append(self)

    def pool(self):
        return ("pool", id(FakeGraph.made[0]))

    def reset(self):
        self.resets += 1


@pytest.fixture
def calls(monkeypatch):
    log = []
    FakeGraph.made = []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("capture", pool, stream))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("stream", str(device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return log


def test_one_stream_one_pool_workspaces_freed_before_the_first_capture(calls):
    cap = C.Capture(torch.device("cuda:0"))
    assert calls == ["sync", "clear"]
    with cap.graph() as first:
        pass
    with cap.graph() as second:
        pass
    stream = ("stream", "cuda:0")
    assert calls[2:] == [("capture", None, stream), ("capture", first.pool(), stream)]
    assert first is not second and cap.failed == []


def test_a_failed_capture_is_kept_until_close(calls):
    cap = C.Capture(torch.device("cuda:0"))
    with cap.graph() as ok:
        pass
    with pytest.raises(RuntimeError, match="not capturable"):
        with cap.graph():
            raise RuntimeError("not capturable")
    bad = FakeGraph.made[-1]
    assert cap.failed == [bad] and bad.resets == 0
    cap.close([ok])
    assert ok.resets == 1 and bad.resets == 1 and cap.failed == []
