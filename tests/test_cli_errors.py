"""Every user mistake in `opmap run` is one line on stderr and a non-zero exit (2 for usage, 1 for
bad input), never a traceback; an unexpected error is one line too, with its traceback under -v."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from opmap.cli import main as cli

RUN = ["run", "--model", "tiny-llama3", "--prompt", "hi", "--max-tokens", "2", "--no-progress"]


def _err(capsys) -> list:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not _selector_line(ln)]


def _selector_line(ln: str) -> bool:
    return "[prefill]" in ln or "[decode]" in ln or "[mixed]" in ln or ln.startswith("sampler")


def _main(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's usage errors
        return e.code


@pytest.mark.parametrize("extra,code,words", [
    (["--max-tokens", "0"], 2, "--max-tokens"),
    (["--quantize", "int2"], 2, "--quantize"),
    (["--temperature", "nan"], 1, "temperature"),
    (["--top-p", "0"], 1, "top_p"),
    (["--backend", "attention=nope"], 2, "no backend 'nope'"),
    (["--backend", "nosuchop=triton"], 2, "no op 'nosuchop'"),
    (["--num-requests", "-1"], 2, "--num-requests"),
    (["--num-pages", "0"], 2, "--num-pages"),
    (["--prefill-graph-tokens", "-5"], 2, "--prefill-graph-tokens"),
    (["--json", "/no/such/folder/out.json"], 2, "does not exist"),
])
def test_bad_flags_are_one_line(extra, code, words, capsys):
    assert _main(RUN + extra) == code
    err = _err(capsys)
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err


def test_forced_backend_from_the_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("OPMAP_ATTENTION_BACKEND", "bogus")
    assert _main(RUN) == 1
    err = _err(capsys)
    assert len(err) == 1 and "OPMAP_ATTENTION_BACKEND=bogus" in err[0], err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from opmap.model.hf import save_checkpoint
    from opmap.model.presets import PRESETS

    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    save_checkpoint(PRESETS["tiny-llama3"], path)
    return path


def _broken(ckpt, tmp_path, how) -> str:
    path = str(tmp_path / how)
    shutil.copytree(ckpt, path)
    if how == "bad-json":
        open(os.path.join(path, "config.json"), "w").write("{ not json")
    elif how == "incomplete":
        d = json.load(open(os.path.join(path, "config.json")))
        d.pop("hidden_size")
        json.dump(d, open(os.path.join(path, "config.json"), "w"))
    elif how == "truncated":
        fn = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
        data = open(os.path.join(path, fn), "rb").read()
        open(os.path.join(path, fn), "wb").write(data[:100])
    elif how == "tokenizer":
        open(os.path.join(path, "tokenizer.json"), "w").write("garbage")
    elif how == "escaping-index":
        idx = os.path.join(path, "model.safetensors.index.json")
        d = json.load(open(idx))
        k = next(iter(d["weight_map"]))
        d["weight_map"][k] = "../outside.safetensors"
        json.dump(d, open(idx, "w"))
    return path


@pytest.mark.parametrize("how,words", [("bad-json", "config.json"), ("incomplete", "hidden_size"),
                                       ("truncated", ".safetensors"), ("tokenizer", "tokenizer.json"),
                                       ("escaping-index", "inside the checkpoint directory")])
def test_bad_checkpoints_are_one_line(ckpt, tmp_path, how, words, capsys):
    path = _broken(ckpt, tmp_path, how)
    assert _main(["run", "--model", path, "--prompt", "hi", "--max-tokens", "2", "--no-progress"]) == 1
    err = _err(capsys)
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err


def test_an_unexpected_error_is_one_line_and_its_traceback_under_v(monkeypatch, capsys):
    import opmap.cli.run as cr

    def boom(args):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(cr, "cli_run", boom)  # build_parser takes the function from the module
    assert _main(RUN) == 1
    err = _err(capsys)
    assert err == ["opmap run: unexpected error: RuntimeError: a bug over two lines (run with -v for the traceback)"]
    with pytest.raises(RuntimeError):
        cli.main(["-v"] + RUN)


def test_no_traceback_from_a_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "opmap.cli.main", *RUN, "--top-p", "0"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if not _selector_line(ln)][-1].startswith("opmap run: error: top_p")


def test_models_lists_presets_and_architectures(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama3-8b", "deepseek-v2-lite", "tiny-qwen3moe"):
        assert name in out
    assert "architectures (config.json model_type)" in out
    from opmap.model.hf import HF_TYPES

    for mt in HF_TYPES:  # each with the fields it reads and refuses
        assert f"│ {mt} " in out, mt
    assert "e_score_correction_bias" in out and "use_sliding_window" in out


def test_one_resolver_takes_a_preset_a_directory_or_a_config_json(ckpt):
    from opmap.core.contract import InputError
    from opmap.model.hf import resolve_model

    by_dir, path = resolve_model(ckpt)
    by_json, none = resolve_model(os.path.join(ckpt, "config.json"))
    assert path == ckpt and none is None and by_dir.hidden == by_json.hidden == 64
    assert resolve_model("tiny-llama3")[1] is None
    with pytest.raises(InputError, match="a preset .* a checkpoint directory or a config.json"):
        resolve_model("no-such-model")


def test_report_takes_a_checkpoint_directory(ckpt, tmp_path, capsys):
    assert cli.main(["report", "--model", ckpt, "--no-check", "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert md.startswith(f"# opmap report: {ckpt} on ")
    assert _main(["report", "--model", "no-such-model"]) == 1
    assert "opmap report: error: model: got 'no-such-model'" in capsys.readouterr().err


def test_report_plans_for_another_gpu_from_its_baselines(tmp_path, capsys):
    """--arch sm90 on this CPU machine: the sm90 selection, nothing run, and per operator the
    nearest measured row of the selected backend in bench/baselines/h200 (file, commit); stdout
    gets the summary (one screen) and the output path, the Markdown starts with the same summary."""
    assert cli.main(["report", "--model", "llama3-8b", "--arch", "sm90", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) <= 40 and out[0] == "opmap report: llama3-8b (llama, 32 layers) planned for sm90"
    assert out[-1].startswith("wrote ") and "report.md" in out[-1]
    # the engine's padded prefill steps (CUDA graphs) run the capturable attention backend: on sm90's
    # 64-token pages the TMA prefill's
    assert "    prefill steps of up to 2048 tokens, replayed from CUDA graphs: `triton-tma` (opmap-triton)" in out
    doc = json.loads((tmp_path / "p" / "report.json").read_text())
    assert doc["planned"] and doc["arch"] == "sm90" and doc["baseline_gpu"] == "h200"
    dec = {r["label"]: r for r in doc["operators"]["decode"]}
    att = dec["attention (paged)"]
    assert att["backend"] == "triton" and att["expected"]["file"] == "h200/attention.json"
    assert att["expected"]["op"] == "attention.decode" and att["expected"]["commit"]
    assert dec["QKV proj"]["backend"] == "triton-decode" and dec["QKV proj"]["expected"]["case"].startswith("M=1,")
    # the fused gate/up row is timed by the gated bench's rows (gemm.gated), never by linear's
    gu = dec["gate/up proj + SiLU * mul (one launch)"]
    assert gu["backend"] == "triton-decode" and gu["entry"] == "linear_act"
    assert gu["expected"] is None or gu["expected"]["op"] == "gemm.gated"
    pre = {r["label"]: r for r in doc["operators"]["prefill"]}
    assert pre["QKV proj"]["backend"] == "cublas" and pre["QKV proj"]["expected"]["provider"] == "cublas"
    md = (tmp_path / "p" / "report.md").read_text()
    assert "planned for sm90" in md and "expected on H200 (its baseline, at this model's shape)" in md
    assert "h200/gemm.json" in md
    # each expected time at the model's shape, scaled from its case by the roofline, or none, with the
    # reason; the target's library versions are not this machine's; rejections in their own section
    assert dec["QKV proj"]["scaled"]["how"] == "measured at this shape"
    assert pre["gate/up proj"]["scaled"]["us"] == pre["gate/up proj"]["expected"]["median_us"]
    assert pre["RMSNorm"]["scaled"]["us"] is None and "too far to scale" in pre["RMSNorm"]["scaled"]["why"]
    assert att["scaled"]["us"] is None and "counts no bytes" in att["scaled"]["why"]
    assert all(r["version"] is None for rows in doc["operators"].values() for r in rows if r["backend"])
    assert "2.13.0+cpu" not in md.split("## Rejected backends")[0].split("## Operator map")[1]
    assert max(len(ln) for ln in md.split("## Rejected backends")[0].splitlines()) < 700
    assert "## Rejected backends" in md and "    - reference at " in md
    assert md.index("## Summary") < md.index("## Operator map, prefill")
    # the pictures: the roofline of the baseline cases behind the expected times, the expected time
    # of each operator call; the HTML carries both inline; a planned prefill on FlashInfer says what
    # runs without it
    assert (tmp_path / "p" / "roofline.png").stat().st_size > 10000 and (tmp_path / "p" / "phases.png").is_file()
    html = (tmp_path / "p" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "<table>" in html and "planned for sm90" in html
    assert "roofline.png" in out[-1] and "report.html" in out[-1]
    if pre["attention (paged)"]["backend"] == "flashinfer":
        assert pre["attention (paged)"]["without_optional"] == "triton-tma" and "else `triton-tma`" in md
    assert cli.main(["report", "--model", "llama3-8b", "--arch", "sm80", "--out", str(tmp_path / "q")]) == 0
    md80 = (tmp_path / "q" / "report.md").read_text()
    assert "no baseline for sm80" in md80 and "not drawn: no benchmark ran" in md80


def _opmap(*argv, env=None):
    """A subprocess `opmap ...` (the CLI as a user runs it): (exit code, stdout, stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), CUDA_VISIBLE_DEVICES="", **(env or {}))
    e.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "opmap.cli.main", *argv], capture_output=True, text=True, timeout=300, env=e)
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    return p.returncode, p.stdout, p.stderr


def test_run_is_quiet_unless_asked_and_says_what_a_cpu_run_is(tmp_path):
    out = tmp_path / "run.json"
    rc, so, se = _opmap(*RUN, "--json", str(out))
    assert rc == 0
    assert not [ln for ln in se.splitlines() if _selector_line(ln)]  # the selector's lines only at -v
    assert "random weights, so the text below is meaningless" in so
    assert "TB/s" not in so and "waiting on the GPU" not in so  # GPU-only figures
    doc = json.loads(out.read_text())
    o = doc["outputs"][0]
    assert doc["random_weights"] and isinstance(o["text"], str) and len(o["token_ids"]) == 2
    rc, so, se = _opmap("-v", *RUN)
    assert rc == 0 and any(_selector_line(ln) for ln in se.splitlines())
    rc, so, se = _opmap(*RUN, "--quiet")
    assert rc == 0 and len(so.strip().splitlines()) == 1 and se.strip() == ""


def test_presets_build_hf_configs_without_warnings():
    import logging

    from transformers.utils import logging as hf_logging

    from opmap.model.hf import to_hf_config
    from opmap.model.presets import PRESETS

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Catch(level=logging.WARNING)
    hf_logging.get_logger().addHandler(h)
    try:
        for cfg in PRESETS.values():
            to_hf_config(cfg)
    finally:
        hf_logging.get_logger().removeHandler(h)
    assert not [m for m in seen if "original_max_position_embeddings" in m or "rope" in m.lower()], seen


def test_check_on_a_cpu_names_the_backends_it_could_not_run():
    rc, so, se = _opmap("check", "--quick", "--op", "rmsnorm")
    assert rc == 0
    assert "not exercised here (no CUDA device and TRITON_INTERPRET is not 1" in so and "): triton" in so
