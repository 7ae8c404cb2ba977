"""The end-to-end benchmark's engine side on the CPU with a tiny preset: the records carry the
fields the result files promise (TTFT, TPOT, floor, host ms per step), and the structured-output
case runs with and without the grammar-fill overlap. Timings here mean nothing (CPU, reference
ops); the GPU run is what is reported."""
import pytest

from opmap.bench.cases import e2e

from test_engine_util import single_thread  # noqa: F401


class _Ceil:
    read_tbps = 4.0


def test_engine_cases_records_and_grammar_overlap_variants(single_thread):
    pytest.importorskip("xgrammar")
    from opmap.engine.llm import LLM
    from opmap.presets import get_preset

    model = "tiny-llama3"
    with LLM(model, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=256) as llm:
        out, skipped = [], []
        e2e._engine_cases(llm, model, get_preset(model), [(model, 1, 20, 6), (model, "json32", 12, 5)], _Ceil(),
                          out, skipped)
        assert llm.ecfg.overlap_grammar  # restored after the serial variant
    assert not skipped, skipped
    b1, js, serial = out
    assert b1["case"].startswith(f"model={model},B=1") and b1["tpot_ms"] > 0 and b1["weight_floor_ms"] > 0
    assert set(b1["host_ms"]["decode"]) >= {"forward", "sample", "wait"} and b1["steps"]["decode"] == 5
    assert len(b1["runs"]) == e2e.REPS_B1 and b1["tpot_ms"] in [r["tpot_ms"] for r in b1["runs"]]
    assert sorted(r["tpot_ms"] for r in b1["runs"])[e2e.REPS_B1 // 2] == b1["tpot_ms"]  # the median run
    assert js["provider"] == "opmap-engine" and serial["provider"] == "opmap-engine[serial grammar fill]"
    for r in (js, serial):
        assert r["structured_overhead"] is not None and r["host_ms"]["decode"]["grammar"] > 0
        assert "first constrained request (warm-up, untimed)" in r["note"]  # one-time costs kept out
