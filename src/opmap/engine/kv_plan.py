"""How many KV pages an engine on a GPU gets: pure arithmetic over measured memory figures, so it
is unit-tested on the CPU with the numbers seen on real devices.

Two limits, the smaller wins:

- the budget: ``gpu_memory_fraction`` of the device's total memory, less what this engine holds
  (weights and step buffers), its warm-up activation peak and the memory outside PyTorch's
  allocator (CUDA context, other processes);
- what is actually free: device-free memory plus what PyTorch's caching allocator holds unused,
  less the activation peak and a safety margin (CUDA-graph pools, sampler buffers). Another
  engine (or any tensor) still alive in the same process is not counted in the first limit but
  is in this one, so a second engine gets what is left instead of a negative size or an OOM.

The warm-up peak is the warm-up's *own*: ``max_memory_allocated`` during the warm-up minus what
was allocated just before it (the first GPU runs counted every live tensor of the process,
including a previous engine's whole KV cache, as "activations": -58 GiB "available").

Pages beyond ``max_num_seqs`` full-length sequences are never useful, so the count is capped
there too (a tiny model on a 141 GB device would otherwise get ~16 million pages, and the
block manager one Python object per page: tens of seconds per engine).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2 ** 30


@dataclass
class MemFigures:
    total: int  # device memory
    free: int  # device-free memory (cudaMemGetInfo) after the warm-up's scratch was released
    reserved: int  # held by this process's caching allocator
    allocated: int  # of which allocated (live tensors of the whole process)
    own: int  # allocated by this engine so far (weights, step buffers)
    act_peak: int  # the warm-up's own peak above what was allocated before it
    graph_pool: int = 0  # held for the prefill CUDA graphs' pool (up to one more activation peak)


def margin_bytes(total: int) -> int:
    """Headroom kept free beyond the activation peak: decode CUDA-graph pools, sampler work
    buffers, the allocator's fragmentation. 1 GiB, or 4% of a small device."""
    return min(GiB, int(0.04 * total))


def plan_pages(m: MemFigures, fraction: float, page_bytes: int, max_useful: int) -> tuple:
    """(pages, explanation). Raises RuntimeError naming what holds the memory when fewer than
    two pages fit."""
    outside = max(m.total - m.free - m.reserved, 0)  # CUDA context, other processes
    budget = m.total * fraction - outside - m.own - m.act_peak - m.graph_pool
    usable = m.free + (m.reserved - m.allocated) - m.act_peak - m.graph_pool - margin_bytes(m.total)
    avail = min(budget, usable)
    n = int(avail // page_bytes) if avail > 0 else 0
    pool = f", prefill graph pool {m.graph_pool / GiB:.2f} GiB" if m.graph_pool else ""
    others_here = max(m.allocated - m.own, 0)  # live tensors of this process outside this engine
    why = (f"budget {budget / GiB:.2f} GiB (gpu_memory_fraction={fraction} of {m.total / GiB:.1f} GiB, less "
           f"this engine's weights and buffers {m.own / GiB:.2f} GiB, warm-up activation peak "
           f"{m.act_peak / GiB:.2f} GiB{pool}, {outside / GiB:.2f} GiB outside PyTorch); free "
           f"{usable / GiB:.2f} GiB after the activation peak and a {margin_bytes(m.total) / GiB:.2f} GiB margin")
    if n < 2:
        hint = ("raise gpu_memory_fraction or lower max_num_batched_tokens" if budget <= usable else
                f"this process holds {others_here / GiB:.2f} GiB outside this engine (another LLM not closed? "
                f"call its close() or del it, then gc.collect() and torch.cuda.empty_cache()), and "
                f"{outside / GiB:.2f} GiB is held outside PyTorch (CUDA context, other processes)")
        raise RuntimeError(f"no memory left for the KV cache ({page_bytes / 2**20:.2f} MiB per page): {why}; {hint}")
    if n > max_useful:
        n = max_useful
        why += f"; capped at {max_useful} pages (max_num_seqs full-length sequences)"
    return n, why
