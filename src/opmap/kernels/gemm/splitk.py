"""The split-K tile counters that every GEMM kernel of the family shares (triton_gemm.py,
wo_gluon.py, wo_wgmma.py): the program that finishes an output tile last (an atomic counter per
tile) sums the tile's fp32 partials in split order and resets the counter for the next call.

One set of buffers serves all three kernels, so the graphs of a device keep sharing one graph
buffer whichever kernel each of their GEMMs runs (they replay in stream order)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict = {}  # (device, stream) -> int32 tile counters of eager calls, zero between calls
_GRAPH_COUNTERS: dict = {}  # device -> the tile counters of calls captured in CUDA graphs
_RETIRED: list = []   # outgrown counter buffers: a captured CUDA graph may still point at one


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def sm_count(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 8


def counters(tiles: int, device: torch.device) -> torch.Tensor:
    """The split-K tile counters for this device and stream. Stream order (and, under PDL, each
    program's wait for the previous kernel before it touches them) keeps two GEMMs of one stream
    from sharing them at once; two streams never share them.

    A call captured in a CUDA graph takes the device's graph counters instead, which an eager call
    made and zeroed before the capture; the graphs of a device share them, so they replay in
    stream order. Counters made during a capture would come from the graph's memory pool
    uninitialised (their zero-fill is a node of that one graph, run only when it replays), and
    the pool hands out the same memory to the temporaries of graphs captured before in it, which
    overwrite them at each of their replays."""
    if capturing(device):
        buf = _GRAPH_COUNTERS.get(device)
        if buf is None or buf.numel() < tiles:
            raise RuntimeError(f"a split-K GEMM of {tiles} output tiles is being captured in a CUDA graph before an "
                               f"eager call of that size on {device}: run it once outside the capture first "
                               f"(that call makes the graph counters)")
        return buf
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _RETIRED.append(buf)
        # Every plan()-made split has fewer than four tiles an SM: one buffer serves them all.
        n = max(tiles, 4 * sm_count(device))
        buf = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    graph = _GRAPH_COUNTERS.get(device)
    if graph is None or graph.numel() < buf.numel():
        if graph is not None:
            _RETIRED.append(graph)
        _GRAPH_COUNTERS[device] = torch.zeros(buf.numel(), dtype=torch.int32, device=device)
    return buf


@triton.jit
def finish(acc, b_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, pid_m, pid_k,
           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The end of a swap-AB tile (acc: [BLOCK_N, BLOCK_M] fp32 of out^T, already scaled): with one
    split, bias and store; with several, the partial to the workspace [SPLIT, M, N], and the program
    that finishes the tile last (its counter) sums the partials in split order, adds the bias,
    stores and resets the counter for the next call."""
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    if SPLIT > 1:
        part = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        mn = M.to(tl.int64) * N
        tl.store(part + pid_k * mn, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        tile = cnt_ptr + pid_m * tl.num_programs(0) + tl.program_id(0)
        last = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sp in range(SPLIT):  # .cg: the other splits' partials are in L2, never in this SM's L1
                acc += tl.load(part + sp * mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        o_ptrs = o_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask)
