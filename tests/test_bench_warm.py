"""The benchmark's compile warm-up (bench.runner._warm_compiles, bench.warm_child): every case's
providers run once in worker processes before the timing pass; nothing is timed there."""
from opmap.harness.bench import runner
from opmap.harness.bench import warm_child
from opmap.harness.bench.base import BenchCase, Provider


def _case(calls, avail=None):
    def ok(inp):
        return lambda: calls.append(("ok", inp["x"]))

    def bad(inp):
        def run():
            calls.append(("bad", inp["x"]))
            raise RuntimeError("no kernel")
        return run

    provs = [Provider("fine", ok), Provider("raises", bad),
             Provider("absent", ok, available=lambda: "not on this machine")]
    return BenchCase("rmsnorm", "R=1", 1.0, 1.0, setup=lambda d: {"x": 7}, providers=provs)


def test_warm_case_calls_each_runnable_provider_once():
    import torch

    calls = []
    assert warm_child.warm_case(_case(calls), torch.device("cpu")) == (1, 1)
    assert calls == [("ok", 7), ("bad", 7)]  # the unavailable provider is not called


def test_select_cases_is_the_list_bench_times():
    cases, errors = runner.select_cases(ops=["logits"], quick=True)
    assert cases and not errors and all(c.op == "logits" for c in cases)
    assert [c.case for c in runner.select_cases(ops=["logits"], quick=True)[0]] == [c.case for c in cases]


def test_warm_up_runs_the_cases_in_workers():
    """On the CPU the Triton providers cannot run (skipped); the PyTorch peer of each case runs once."""
    cases = runner.select_cases(ops=["logits"], quick=True)[0]
    got = runner._warm_compiles(cases, 2, dict(ops=["logits"], model=None, quick=True, providers=None,
                                               variants=False), progress=False)
    assert got["workers"] == 2 and got["workers_lost"] == 0
    assert got["ran"] >= len(cases) and got["seconds"] > 0


def test_a_worker_with_another_case_list_answers_each_case_with_the_reason():
    cases = runner.select_cases(ops=["logits"], quick=True)[0]
    got = runner._warm_compiles(cases, 1, dict(ops=["logits", "rmsnorm"], model=None, quick=True, providers=None,
                                               variants=False), progress=False)
    assert got["ran"] == 0 and got["failed"] == len(cases)


def test_warm_up_in_the_background_gives_the_same_record():
    """``opmap report`` starts the warm-up beside its check and hands the waiter to ``bench``."""
    ops = ["logits", "kv_append"]
    cases = runner.select_cases(ops=ops, quick=True)[0]
    assert len(cases) > 1
    got = runner.warm_in_background(ops=ops, quick=True, warm_workers=2, progress=False)()
    assert got["workers"] == 2 and got["workers_lost"] == 0 and got["ran"] >= len(cases)
    assert runner.warm_in_background(ops=ops, quick=True, warm_workers=1)() is None  # 1: no warm-up
    assert runner.warm_in_background(ops=["logits"], quick=True, warm_workers=2)() is None  # one case: none


def test_a_row_note_carries_what_the_provider_describes(monkeypatch):
    # run_case asks a provider what ran (Provider.describe, e.g. the GEMM's tuned config) after
    # timing it and joins that to the timing's own note; providers without it keep that note only.
    from opmap.harness.bench import timing
    from opmap.harness.bench.base import BenchCase, Provider

    monkeypatch.setattr(timing, "num_sets", lambda *a, **k: 1)
    monkeypatch.setattr(timing, "time_calls", lambda calls, **k: timing.Timing(2.0, "events", len(calls), "timed eagerly"))
    case = BenchCase(op="x", case="n=1", flops=0.0, bytes=1e6, setup=lambda device: {}, providers=[
        Provider("ours", lambda inp: (lambda: None), describe=lambda: "BLOCK_K 128 (autotuned)"),
        Provider("peer", lambda inp: (lambda: None))])
    recs, skipped = runner.run_case(case, None, "cpu", quick=True)
    assert not skipped and [r["note"] for r in recs] == ["timed eagerly; BLOCK_K 128 (autotuned)", "timed eagerly"]
