"""KV-cache sizing arithmetic (engine/kv_plan.py) with the memory figures of the first H200 runs,
and LLM.close(): a closed engine drops its cache, weights and buffers and refuses new work."""
import pytest

from opmap.engine.kv_plan import GiB, MemFigures, margin_bytes, plan_pages
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams

from test_engine_util import single_thread  # noqa: F401

H200 = int(140.4 * GiB)
CTX = int(0.5 * GiB)  # CUDA context
MIB2 = 2 * 2 ** 20  # llama3-8b bf16: 32 layers x K,V x 8 heads x 128 x 16 tokens x 2 bytes


def _figs(own, act, other_engine=0.0, cached_unused=0.0):
    """Device figures after the warm-up: this engine holds ``own`` GiB, another live object of the
    process ``other_engine`` GiB; the allocator caches ``cached_unused`` GiB it does not use."""
    alloc = int((own + other_engine) * GiB)
    reserved = alloc + int(cached_unused * GiB)
    return MemFigures(total=H200, free=H200 - CTX - reserved, reserved=reserved, allocated=alloc,
                      own=int(own * GiB), act_peak=int(act * GiB))


def test_alone_the_fraction_is_the_limit():
    n, why = plan_pages(_figs(own=15.0, act=2.0), 0.85, MIB2, max_useful=10 ** 9)
    budget = H200 * 0.85 - CTX - 15 * GiB - 2 * GiB
    assert n == int(budget // MIB2) and "budget" in why


def test_second_engine_gets_what_is_free_instead_of_a_negative_size():
    # The failing GPU test: a previous engine (~97 GiB with its HF model) still alive in the
    # process, a new 2-layer engine (2.8 GiB) at gpu_memory_fraction=0.3. Before, the warm-up peak
    # counted the other engine (99.7 GiB) and the size was -58.53 GiB.
    m = _figs(own=2.8, act=0.6, other_engine=97.0)
    n, _ = plan_pages(m, 0.3, MIB2, max_useful=10 ** 9)
    usable = m.free - m.act_peak - margin_bytes(H200)
    budget = H200 * 0.3 - CTX - 2.8 * GiB - 0.6 * GiB
    assert n == int(min(usable, budget) // MIB2) and n > 1000
    # The tiny-llama3 check case: the plain run's engine holds 118 GiB of cache at 0.85; the
    # second engine fits in what is left, never in more.
    m = _figs(own=0.01, act=0.05, other_engine=118.1)
    n, why = plan_pages(m, 0.85, 8192, max_useful=10 ** 9)
    assert 0 < n * 8192 <= m.free - m.act_peak and "free" in why


def test_nothing_left_names_what_holds_memory():
    m = _figs(own=15.0, act=2.0, other_engine=122.0)
    with pytest.raises(RuntimeError, match=r"holds 122\.00 GiB outside this engine.*close\(\)"):
        plan_pages(m, 0.85, MIB2, max_useful=10 ** 9)
    # Alone but with too small a fraction: the hint is about the fraction / token budget.
    with pytest.raises(RuntimeError, match="raise gpu_memory_fraction"):
        plan_pages(_figs(own=15.0, act=2.0), 0.1, MIB2, max_useful=10 ** 9)


def test_cached_unused_blocks_count_as_free_and_pages_are_capped():
    m = _figs(own=1.0, act=0.5, other_engine=0.0, cached_unused=30.0)
    n, _ = plan_pages(m, 0.85, MIB2, max_useful=10 ** 9)
    assert n == int((H200 * 0.85 - CTX - 1.5 * GiB) // MIB2)  # the cache the allocator holds is usable
    n, why = plan_pages(m, 0.85, 8192, max_useful=8 * 128)  # tiny model: 8 sequences x 128 pages
    assert n == 1024 and "capped" in why


def test_close_frees_and_refuses_work(single_thread):
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM("tiny-llama3", max_num_seqs=2, num_pages=16) as llm:
        assert len(llm.generate([[1, 2, 3]], sp)[0].token_ids) == 3
        runner = llm.runner
    assert llm.closed and runner.kv is None and runner.model is None and runner.graphs == {}
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], sp)
    llm.close()  # idempotent
