"""`opmap profile --trace AFTER --baseline BEFORE`: which operator moved. On two real traces of the
same workload (HF Llama generate with SDPA, then with eager attention) and on traces built here for
a backend switch and a lost CUDA graph."""
import json
from pathlib import Path

import pytest
from test_profile_rules import DTOH, NVJET, RMS, Builder, K

from opmap.cli import main as cli
from opmap.harness.profile import analyze
from opmap.harness.profile import diff
from opmap.harness.profile import trace

DATA = Path(__file__).parent / "data" / "traces"


def _res(name):
    return analyze.analyze(trace.load(str(DATA / f"{name}.json.gz")))


def test_sdpa_to_eager_attention_moves_attention_only():
    """The same generate run with SDPA (cuDNN) and with eager attention: in both phases attention
    moved (cuDNN's kernel vanished, the softmax and a matmul appeared), the GEMMs did not, and the
    categories' changes add up to the change of GPU busy time."""
    d = diff.compare(_res("hf-llama-sdpa"), _res("hf-llama-eager-stack"))
    assert set(d["phases"]) == {"prefill", "decode"} and not d["only_before"] and not d["only_after"]
    for ph, p in d["phases"].items():
        cats = p["categories"]
        att, gemm = cats["attention"], cats["GEMM"]
        assert att[1] > 1.5 * att[0] and abs(gemm[1] - gemm[0]) < 0.05 * gemm[0]
        moved = max(cats, key=lambda c: abs(cats[c][1] - cats[c][0]))
        assert moved == "attention", (ph, cats)
        assert sum(v[1] - v[0] for v in cats.values()) == pytest.approx(p["busy_ms"][1] - p["busy_ms"][0], abs=1e-3)
        assert any(f.startswith("cudnn_generated_fort_native_sdpa") for f, _ in p["vanished"])
        assert "cuDNN" in p["libraries"]["attention"][0] and "cuDNN" not in p["libraries"]["attention"][1]
    assert any(f == "softmax_warp_forward" for f, _ in d["phases"]["prefill"]["appeared"])


def test_cli_diff_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = cli.main(["profile", "--trace", str(DATA / "hf-llama-eager-stack.json.gz"), "--baseline",
                   str(DATA / "hf-llama-sdpa.json.gz"), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "[decode] 5 -> 5 steps; step " in text and "attention" in text and "vanished" in text
    doc = json.loads(out.read_text())
    assert set(doc) == {"before", "after", "diff"} and "decode" in doc["diff"]["phases"]


def test_baseline_takes_one_trace(capsys):
    f = str(DATA / "hf-llama-sdpa.json.gz")
    assert cli.main(["profile", "--trace", f, "--trace", f, "--baseline", f]) == 1
    assert "--baseline" in capsys.readouterr().err


FA3 = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>"
FI = "void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>"


def _decode(attn: str) -> list:
    return [K(RMS, 3, "_C::rms_norm"), K(NVJET, 20, "aten::mm"), K(attn, 30, "vllm::unified_attention"),
            K(NVJET, 20, "aten::mm"), K(RMS, 3, "_C::rms_norm"), K(NVJET, 40, "aten::mm"),
            K("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", 3,
              "aten::argmax"), K(DTOH, 2, "aten::copy_")]


def test_a_backend_switch_and_a_lost_graph(tmp_path):
    """Before: decode steps replayed from CUDA graphs with FA3; after: the same steps launched one
    kernel at a time with FlashInfer's decode. The diff names the switch and the lost graphs, and
    the step time's growth lands in the GPU's idle time."""
    b = Builder()
    for _ in range(4):
        b.replay(_decode(FA3), "execute_model")
    before = b.analyze(tmp_path, "before.json.gz")
    a = Builder()
    for _ in range(4):
        a.step(_decode(FI), "execute_model", gap=400)
    after = a.analyze(tmp_path, "after.json.gz")
    d = diff.compare(before, after)
    p = d["phases"]["decode"]
    assert p["libraries"]["attention"] == (["FlashAttention"], ["FlashInfer"])
    assert [f for f, _ in p["vanished"]] == ["flash::FlashAttnFwdSm90"] and p["appeared"][0][0] == "flashinfer::BatchDecodeWithPagedKVCacheKernel"
    assert p["graph_share"] == (pytest.approx(1.0), 0.0)
    assert p["idle_ms"][1] > p["idle_ms"][0] + 0.3
    text = "\n".join(diff.format_lines(d))
    assert "graphs lost" in text and "[FlashAttention -> FlashInfer]" in text
