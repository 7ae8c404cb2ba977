"""Bad input through the `opmap` command, as a new user gives it: every case ends quickly with one
line on stderr that names the flag, the field or the file (exit status 2 for a usage error, 1 for
bad input), never a traceback or "unexpected error"; what used to be accepted silently is refused
or said; one path rule covers every file a checkpoint load opens."""
import json
import math
import os
import shutil
import time

import pytest
import torch

from opmap.cli import main as cli

RUN = ["run", "--model", "tiny-llama3", "--prompt", "hi", "--max-tokens", "2", "--no-progress"]


def _main(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's usage errors
        return e.code


def _selector_line(ln: str) -> bool:
    return "[prefill]" in ln or "[decode]" in ln or "[mixed]" in ln or ln.startswith("sampler")


def _one_line(capsys, argv, code: int, *words, limit: float = 120.0) -> str:
    """Run ``opmap argv``: exit status ``code`` within ``limit`` seconds, one line on stderr holding
    every one of ``words``, no traceback; returns that line."""
    t0 = time.perf_counter()
    rc = _main(argv)
    took = time.perf_counter() - t0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not _selector_line(ln)]
    assert rc == code, (rc, err)
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and "unexpected error" not in err[0], err[0]
    for w in words:
        assert w in err[0], (w, err[0])
    assert took < limit, f"{argv} took {took:.0f} s"
    return err[0]


# ---- sizes: bounded by the model and the machine, refused up front -------------------------------

@pytest.mark.parametrize("extra,code,words", [
    (["--max-num-seqs", "1000000000"], 1, ("max_num_seqs", "max_num_batched_tokens")),  # ran until killed
    (["--num-requests", "1000000000000", "--input-len", "4", "--output-len", "2"], 1, ("--num-requests", "memory")),
    (["--page-size", "1048576"], 1, ("page_size", "2048")),  # was an allocation failure
    (["--num-pages", "1000000000000"], 1, ("num_pages", "KV cache")),
    (["--max-num-batched-tokens", "1000000000000"], 1, ("max_num_batched_tokens",)),
    (["--seed", str(10 ** 24)], 2, ("--seed", "2**63")),  # was an overflow
    (["--max-model-len", "4096"], 1, ("max_model_len", "at most 2048", "max_position_embeddings")),
    (["--max-model-len", "1000000000"], 1, ("max_model_len", "at most 2048")),  # was capped silently
    (["--max-num-batched-tokens", "1", "--no-chunked-prefill"], 1,
     ("request 0", "max_num_batched_tokens (1) without chunked prefill")),  # was exit 1, no message
])
def test_engine_sizes(extra, code, words, capsys):
    _one_line(capsys, RUN + extra, code, *words, limit=60)


def test_a_huge_seed_within_range_runs(capsys):
    assert _main(RUN + ["--seed", str(2 ** 63 - 1)]) == 0


def test_prefill_chunks_are_counted_as_prefill(tmp_path, capsys):
    """An 11-token prompt at a budget of one token: 11 prefill steps (the last one samples the first
    token) and 2 decode steps, where the summary said "prefill 0 ... decode 13"."""
    out = tmp_path / "run.json"
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    assert _main(["run", "--model", "tiny-llama3", "--num-requests", "1", "--input-len", "11", "--output-len", "3",
                  "--max-num-batched-tokens", "1", "--no-progress", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())["summary"]["steps"]
    assert steps == {"prefill": 11, "mixed": 0, "decode": 2}, steps
    assert "steps: prefill 11 " in capsys.readouterr().out
    from opmap.engine.llm import LLM
    from opmap.engine.params import SamplingParams

    with LLM("tiny-llama3", max_num_batched_tokens=4) as llm:  # a chunk beside a decode row is mixed
        llm.generate(prompt + [[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True))
        s = llm.last_summary["steps"]
    assert s["prefill"] >= 1 and s["mixed"] >= 1 and s["decode"] >= 1, s


# ---- a checkpoint folder and its files -------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from opmap.engine.tokenizer import byte_tokenizer
    from opmap.model.hf import save_checkpoint
    from opmap.model.presets import PRESETS

    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    save_checkpoint(PRESETS["tiny-llama3"], path, tokenizer=byte_tokenizer(PRESETS["tiny-llama3"].vocab))
    return path


def _copy(ckpt, tmp_path, name="c") -> str:
    path = str(tmp_path / name)
    shutil.copytree(ckpt, path)
    return path


def _edit_json(path, fn, name="config.json") -> None:
    f = os.path.join(path, name)
    d = json.load(open(f)) if os.path.isfile(f) else {}
    fn(d)
    with open(f, "w") as out:
        json.dump(d, out)


def _run(path, *extra) -> list:
    return ["run", "--model", path, "--prompt", "hi", "--max-tokens", "2", "--no-progress", *extra]


def _set(**kw):
    return lambda d: d.update(kw)


def _nan_rope(d):
    d["rope_parameters"]["rope_theta"] = math.nan


def _drop(*names):
    def fn(d):
        for n in names:
            d.pop(n)
    return fn


def _hidden7(d):
    d.pop("head_dim")
    d["hidden_size"] = 7


@pytest.mark.parametrize("edit,words", [
    (_set(hidden_size="64"), ("config.json hidden_size", "'64'", "an integer")),  # was a StrictDataclass error
    (_set(num_hidden_layers=2.5), ("config.json num_hidden_layers", "2.5")),
    (_hidden7, ("config.json hidden_size", "a multiple of num_attention_heads")),
    (_set(num_key_value_heads=3), ("config.json num_key_value_heads", "a divisor of num_attention_heads")),
    (_set(intermediate_size=-5), ("config.json intermediate_size", "-5")),  # was a negative tensor dimension
    (_set(max_position_embeddings=0), ("config.json max_position_embeddings", ">= 2")),  # was a bare exit 1
    (_set(max_position_embeddings=-4), ("config.json max_position_embeddings",)),
    (_nan_rope, ("rope_theta", "nan", "positive finite")),  # was a bare exit 1
    (_set(rms_norm_eps=-1.0), ("config.json rms_norm_eps",)),
    (_drop("intermediate_size"), ("config.json", "'intermediate_size'")),  # was "128 rows for a fused tensor of 22016"
    (_set(head_dim=32), ("q_proj", "v_proj", "head_dim")),  # disagrees with the weights: the tensors and the field
    (_set(num_experts_per_tok=3, num_local_experts=2, model_type="mixtral"), ("num_experts_per_tok",)),
])
def test_a_malformed_config_json_names_its_field(ckpt, tmp_path, edit, words, capsys):
    path = _copy(ckpt, tmp_path)
    _edit_json(path, edit)
    _one_line(capsys, _run(path), 1, *words)


def _shard(path) -> str:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]


def _rewrite_tensor(path, fn) -> str:
    """Apply ``fn`` to the first tensor of the first shard; returns its name."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, _shard(path))
    d = load_file(f)
    name = sorted(d)[0]
    d[name] = fn(d[name])
    save_file(d, f, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("how,words", [
    ("nan", ("NaN or inf",)), ("inf", ("NaN or inf",)),  # was exit 1 with no message
    ("int32", ("dtype torch.int32", "floating-point")), ("bool", ("dtype torch.bool",)),  # were cast silently
])
def test_weights_that_are_not_finite_floats_are_refused_by_name(ckpt, tmp_path, how, words, capsys):
    path = _copy(ckpt, tmp_path)

    def bad(t):
        if how in ("nan", "inf"):
            t = t.clone()
            t.view(-1)[3] = math.nan if how == "nan" else math.inf
            return t
        return t.to(torch.int32) if how == "int32" else t > 0

    name = _rewrite_tensor(path, bad)
    _one_line(capsys, _run(path), 1, f"checkpoint tensor {name}", *words)


def test_index_weight_map_as_a_list(ckpt, tmp_path, capsys):
    path = _copy(ckpt, tmp_path)
    _edit_json(path, lambda d: d.update(weight_map=list(d["weight_map"])), "model.safetensors.index.json")
    _one_line(capsys, _run(path), 1, "model.safetensors.index.json weight_map", "list")


@pytest.mark.parametrize("text,words", [
    ("{ not json", ("generation_config.json", "not JSON")),
    (json.dumps({"eos_token_id": ["</s>"]}), ("generation_config.json eos_token_id", "'</s>'")),
    (json.dumps({"eos_token_id": [2, 100000]}), ("generation_config.json eos_token_id", "[0, 512)")),  # never fired
    (json.dumps({"eos_token_id": -1}), ("generation_config.json eos_token_id", "-1")),
    (json.dumps([1, 2]), ("generation_config.json", "a JSON object")),
])
def test_a_malformed_generation_config(ckpt, tmp_path, text, words, capsys):
    path = _copy(ckpt, tmp_path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write(text)
    _one_line(capsys, _run(path), 1, *words)


def test_stop_token_ids_beyond_the_vocabulary_fail_that_request():
    from opmap.engine.llm import LLM
    from opmap.engine.params import SamplingParams

    with LLM("tiny-llama3", num_pages=16) as llm:
        bad, good = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=2, stop_token_ids=[512]),
                                                        SamplingParams(max_tokens=2, ignore_eos=True)])
    assert bad.finish_reason == "error" and bad.error == "stop_token_ids: got id 512, expected ids in [0, 512)"
    assert good.error is None and len(good.token_ids) == 2


# ---- one path rule: links and pickles ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json"])
@pytest.mark.parametrize("relative", [False, True])
def test_a_link_out_of_the_checkpoint_folder_is_refused(ckpt, tmp_path, name, relative, capsys):
    path = _copy(ckpt, tmp_path)
    if name == "model.safetensors":  # a shard of the index
        name = _shard(path)
    elif name == "generation_config.json":
        _edit_json(path, lambda d: d.update(eos_token_id=1), name)
    outside = tmp_path / f"outside-{name}"
    shutil.move(os.path.join(path, name), outside)
    os.symlink(os.path.relpath(outside, path) if relative else str(outside), os.path.join(path, name))
    _one_line(capsys, _run(path), 1, f"{path}/{name}", "a link to", "outside the checkpoint directory")


def test_links_inside_the_folder_and_a_cache_snapshot_are_followed(ckpt, tmp_path, capsys):
    """A link to a file of the folder, and the layout of the Hugging Face cache (a snapshot's files
    link to the repository's blobs/) load."""
    repo = tmp_path / "models--x"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(os.listdir(ckpt))):
        shutil.copy(os.path.join(ckpt, f), blobs / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snap / f)
    assert _main(_run(str(snap))) == 0
    inner = _copy(ckpt, tmp_path, "inner")
    os.rename(os.path.join(inner, "tokenizer.json"), os.path.join(inner, "tok-real.json"))
    os.symlink("tok-real.json", os.path.join(inner, "tokenizer.json"))
    assert _main(_run(inner)) == 0
    capsys.readouterr()


def test_an_index_entry_out_of_the_folder_is_refused(ckpt, tmp_path, capsys):
    path = _copy(ckpt, tmp_path)
    _edit_json(path, lambda d: d["weight_map"].update({k: "../x.safetensors" for k in list(d["weight_map"])[:1]}),
               "model.safetensors.index.json")
    _one_line(capsys, _run(path), 1, "model.safetensors.index.json", "inside the checkpoint directory")


def _pickle_only(ckpt, tmp_path) -> str:
    path = _copy(ckpt, tmp_path, "pickled")
    for f in os.listdir(path):
        if f.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, f))
    torch.save({"x": torch.ones(2)}, os.path.join(path, "pytorch_model.bin"))
    return path


@pytest.mark.parametrize("command", ["run", "report"])
def test_pickle_files_are_refused_by_name(ckpt, tmp_path, command, capsys):
    """A folder whose weights are only pytorch_model.bin: never unpickled, by `opmap run` nor by
    `opmap report` (whose own-model parity handed it to transformers' from_pretrained)."""
    path = _pickle_only(ckpt, tmp_path)
    argv = _run(path) if command == "run" else ["report", "--model", path, "--out", str(tmp_path / "r")]
    _one_line(capsys, argv, 1, f"{path}/pytorch_model.bin", "pickle", "safetensors")


def test_a_missing_tokenizer_is_said_in_one_line(ckpt, tmp_path, capsys, caplog):
    path = _copy(ckpt, tmp_path)
    os.remove(os.path.join(path, "tokenizer.json"))
    with caplog.at_level("WARNING"):
        assert _main(_run(path)) == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "no tokenizer.json" in said[0] and "byte tokenizer" in said[0], said
    assert "\n" not in said[0]
    os.mkdir(os.path.join(path, "tokenizer.json"))  # a folder in its place
    _one_line(capsys, _run(path), 1, "tokenizer.json", "not a file")


@pytest.mark.parametrize("config,words", [
    ({"tokenizer_class": "FooTokenizer", "auto_map": {"AutoTokenizer": ["tok.FooTokenizer", None]}},
     ("tokenizer_config.json auto_map", "never runs")),  # asked on stdin whether to run the code
    ({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ ''.__class__.__mro__ }}"},
     ("tokenizer_config.json chat_template", "Jinja sandbox", "SecurityError")),
    ({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{% for %}"},
     ("tokenizer_config.json chat_template", "Jinja cannot render")),
])
def test_a_chat_template_that_cannot_run_names_its_file(ckpt, tmp_path, config, words, capsys):
    path = _copy(ckpt, tmp_path)
    _edit_json(path, lambda d: d.update(config), "tokenizer_config.json")
    _one_line(capsys, _run(path, "--chat"), 1, *words)


# ---- the environment and the other commands ----------------------------------------------------------

@pytest.mark.parametrize("var,words", [
    ("OPMAP_FOO_BACKEND", ("OPMAP_FOO_BACKEND", "no op 'FOO'")),
    ("OPMAP_ATTENTION_WARP_BACKEND", ("OPMAP_ATTENTION_WARP_BACKEND", "no phase 'WARP'")),
    ("OPMAP_attention_BACKEND", ("OPMAP_attention_BACKEND", "upper case: OPMAP_ATTENTION_BACKEND")),
])
def test_a_backend_variable_that_forces_nothing(monkeypatch, var, words, capsys):
    monkeypatch.setenv(var, "triton")
    _one_line(capsys, RUN, 1, "environment variable", *words)
    _one_line(capsys, ["select", "rmsnorm"], 1, var)


def test_backend_variables_by_op_and_phase_still_force(monkeypatch, capsys):
    monkeypatch.setenv("OPMAP_KV_APPEND_DECODE_BACKEND", "reference")
    monkeypatch.setenv("OPMAP_ATTENTION_MERGE_BACKEND", "reference")
    assert _main(["select", "kv_append", "--phase", "decode"]) == 0
    assert "forced by env OPMAP_KV_APPEND_DECODE_BACKEND=reference" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["select", "attention", "--heads", "32", "--kv-heads", "7"], ("--kv-heads 7", "divisor of --heads 32")),
    (["select", "attention", "--heads", "8", "--kv-heads", "32"], ("--kv-heads 32",)),
    (["select", "rmsnorm", "--arch", "banana"], ("--arch", "'banana'")),
    (["matrix", "--arch", "banana"], ("--arch", "'banana'")),
    (["check", "--quick", "--timeout", "-1"], ("--timeout", "'-1'")),
    (["check", "--quick", "--timeout", "nan"], ("--timeout",)),
    (["check", "--quick", "--batch", "0"], ("--batch", "'0'")),
    (["check", "--quick", "--resume", "/"], ("--resume", "is a folder")),
    (["check", "--quick", "--reuse", "/no/such.jsonl"], ("--reuse", "an existing file")),
    (["profile", "--model", "tiny-llama3", "--kernels", "-3"], ("--kernels", "'-3'")),
    (["profile", "--model", "tiny-llama3", "--host-ops", "-1"], ("--host-ops",)),
])
def test_usage_errors_name_the_flag(argv, words, capsys):
    _one_line(capsys, argv, 2, *words, limit=30)


@pytest.mark.parametrize("dur,words", [("abc", ("dur 'abc'",)), (-5, ("dur -5", "durations >= 0")),
                                       (math.nan, ("dur nan",))])
def test_a_trace_with_bad_durations(tmp_path, dur, words, capsys):
    ev = [{"name": "ampere_sgemm_128x64_tn", "ph": "X", "cat": "kernel", "ts": 10, "dur": 5, "pid": 0, "tid": 7},
          {"name": "ampere_sgemm_128x64_tn", "ph": "X", "cat": "kernel", "ts": 20, "dur": dur, "pid": 0, "tid": 7}]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": ev}))
    _one_line(capsys, ["profile", "--trace", str(f)], 1, "trace t.json", "ampere_sgemm_128x64_tn", *words)


def test_an_nsys_export_with_a_kernel_ending_before_it_starts(tmp_path, capsys):
    import sqlite3

    f = tmp_path / "run.sqlite"
    db = sqlite3.connect(f)
    db.execute("CREATE TABLE StringIds (id INTEGER, value TEXT)")
    db.execute("INSERT INTO StringIds VALUES (1, 'ampere_sgemm_128x64_tn')")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, demangledName INTEGER, "
               "correlationId INTEGER, streamId INTEGER)")
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 1, ?, 7)", [(1000, 2000, 1), (5000, 4000, 2)])
    db.commit()
    db.close()
    _one_line(capsys, ["profile", "--trace", str(f)], 1, "trace run.sqlite", "ampere_sgemm_128x64_tn",
              "from 5000 to 4000", "end >= start")


def test_the_check_says_each_engine_line_once(caplog):
    """The check's engine cases build engines over the same small cache, each of which said
    "max_model_len 1024, below the model's 2048 positions": `opmap report` printed it six times."""
    from opmap.harness.check import runner

    with caplog.at_level("WARNING", logger="opmap.engine"):
        results, _ = runner.check(ops=["e2e"], sections=["boundaries"], quick=True, progress=False)
    assert results and all(r.passed for r in results), [(r.case, r.figure) for r in results if not r.passed]
    said = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert said and len(said) == len(set(said)), said
