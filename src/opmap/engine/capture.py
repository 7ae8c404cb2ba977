"""CUDA-graph capture for one engine, safe from the other graphs of the process.

PyTorch caches one cuBLAS workspace per (handle, stream), and a captured GEMM bakes that
workspace's address into its graph. Destroying any graph frees the workspace of the stream it
was captured on, and inductor's CUDA graphs (``torch.compile(mode="reduce-overhead")``) free all
of them before each recording (pytorch/pytorch#193402 and ``clear_cublass_cache``). With torch's
shared default capture stream, a workspace allocated outside our pool could then be handed to
another tensor while our graphs still write their split-K partials into it. So an engine
captures on a stream of its own, after freeing the cached workspaces: its first GEMM under
capture allocates the workspace inside the engine's graph pool, which no other allocation
reaches once capture is over (a later free returns it to that pool, not to the process). A graph
whose capture failed is kept until ``close``: its destructor would free the workspace that the
graphs captured before it use, inside the pool the next capture allocates from.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class Capture:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = None  # one memory pool for every graph of the engine, set by the first capture
        self.failed: list = []
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()

    @contextmanager
    def graph(self):
        """``with capture.graph() as g:`` records the body into ``g`` on the engine's stream and pool."""
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                yield g
        except BaseException:
            self.failed.append(g)
            raise
        if self.pool is None:
            self.pool = g.pool()

    def close(self, graphs) -> None:
        """Reset ``graphs`` and the failed captures (after every replay has finished)."""
        for g in [*graphs, *self.failed]:
            try:
                g.reset()
            except RuntimeError:  # a capture that failed may hold no graph to reset
                pass
        self.failed = []
