"""`opmap profile --trace A --trace B` (or a folder): the ranks of one tensor / expert parallel run.
Two fixtures: traces recorded on the CPU through torch.distributed's gloo backend
(scripts/record_tp_traces.py --backend gloo: a TP decoder block and an EP MoE on 2 ranks), and a
synthetic pair built here with NCCL's kernel symbols, a collective overlapping a GEMM on another
stream, and a slower rank."""
import gzip
import json
from pathlib import Path

from opmap.cli import main as cli
from opmap.harness.profile import ranks
from opmap.harness.profile import symbols

GLOO = Path(__file__).parent / "data" / "traces" / "tp-gloo"
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
NCCL_A2A = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT"


def _rank_trace(path, slow: float):
    """Four steps (execute_model ranges); each: a GEMM on stream 7, an all-reduce on stream 13 that
    half overlaps it, an all-to-all after it; ``slow`` stretches this rank's GEMMs."""
    evs, corr, t = [], 0, 0.0
    for _ in range(4):
        evs.append({"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": t, "dur": 400, "pid": 1,
                    "tid": 1})
        for name, stream, start, dur in ((GEMM, 7, 10, 100 * slow), (NCCL_AR, 13, 10 + 50 * slow, 100),
                                         (NCCL_A2A, 13, 200 * slow, 40)):
            corr += 1
            evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + start - 5, "dur": 2,
                        "pid": 1, "tid": 1, "args": {"correlation": corr}})
            evs.append({"ph": "X", "cat": "kernel", "name": name, "ts": t + start, "dur": dur, "pid": 0,
                        "tid": stream, "args": {"correlation": corr, "stream": stream}})
        t += 500
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": evs}, f)


def test_nccl_symbols_are_communication():
    for s in (NCCL_AR, NCCL_A2A):
        assert symbols.classify(s) == ("communication", "NCCL")
    assert symbols.classify("gloo:all_to_all") == ("communication", "gloo")


def test_synthetic_nccl_ranks_overlap_and_straggler(tmp_path):
    _rank_trace(tmp_path / "rank0.json.gz", 1.0)
    _rank_trace(tmp_path / "rank1.json.gz", 1.5)
    res = ranks.analyze_ranks(ranks.trace_files([str(tmp_path)]))
    r0, r1 = res["ranks"]
    assert r0["communication"]["ms"] == (4 * 140) / 1e3  # 100 + 40 us a step, 4 steps
    assert r0["communication"]["overlap"] == round(4 * 50 / (4 * 140), 4)  # half the all-reduce under the GEMM
    assert r0["communication"]["libraries"] == ["NCCL"]
    assert res["steps"] == 4 and res["slowest"] == {1: 4} and res["lag_ms"] > 0
    assert any("rank 1 is the slowest in 4 of 4 steps" in d for d in res["diagnosis"])
    assert any(d.startswith("rank 0: communication takes") and "overlapped" in d for d in res["diagnosis"])
    assert "communication" in res["merged"][next(iter(res["merged"]))]


def test_gloo_traces_of_a_tp_and_ep_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["profile", "--trace", str(GLOO), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== rank 0: communication" in text and "== rank 1: communication" in text and "== merged over 2 ranks" in text
    doc = json.loads(out.read_text())
    assert len(doc["ranks"]) == 2 and doc["steps"] == 4
    for r in doc["ranks"]:
        c = r["communication"]
        assert c["libraries"] == ["gloo"] and c["ms"] > 0 and 0.0 <= c["overlap"] <= 1.0
        cats = set().union(*(p["categories"] for p in r["phases"].values()))
        assert {"communication", "attention", "MoE"} <= cats  # the collectives on gloo's threads, the layer ranges
    merged = set().union(*doc["merged"].values())
    assert "communication" in merged and "MoE" in merged


def test_trace_arguments_repeat_or_name_a_folder(tmp_path, capsys):
    files = ranks.trace_files([str(GLOO / "rank0.json.gz"), str(GLOO / "rank1.json.gz")])
    assert files == ranks.trace_files([str(GLOO)])
    (tmp_path / "empty").mkdir()
    assert cli.main(["profile", "--trace", str(tmp_path / "empty")]) == 1
    assert "--trace" in capsys.readouterr().err
