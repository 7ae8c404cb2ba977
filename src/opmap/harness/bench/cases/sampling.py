"""Sampler benchmark cases: B in {1, 8, 64, 256} x vocab in {32000, 128256, 151936}, fp32 logits
(engines upcast the LM head's output before sampling), with the filter combinations temperature
only / top-k 50 / top-p 0.9 / top-k 50 + top-p 0.9 / min-p 0.05 / all three. Peers in the same
run: PyTorch sort + cumsum + multinomial ("torch-sort"), the exponential race in PyTorch
("torch-race", which sorts too when a filter is on), the unfiltered race as the speed line the
target names ("torch-race-unfiltered": a different, cheaper distribution), FlashInfer where it is
installed ("flashinfer" for one filter kind, "flashinfer-joint" for top-k + top-p in its joint
order, and "flashinfer-joint[from probs]": its kernel alone from precomputed probabilities, as
FlashInfer's own figures are taken). Logits processors (penalties) are a separate line ("logits").

Minimal bytes: the logits read once (B x V x 4) plus the per-row parameters and the ids. FLOPs:
4 per logit (scale, subtract, exp, accumulate), the work of one softmax pass.
"""
from __future__ import annotations

import torch

from opmap.core import hw, registry
from opmap.core.specs import LogitsSpec, SamplingSpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.peers.sampling.flashinfer_peer import filtered_probs

BATCHES = (1, 8, 64, 256)
VOCABS = (32000, 128256, 151936)
FILTERS = {"none": dict(), "top_k": dict(k=50), "top_p": dict(p=0.9), "top_k+top_p": dict(k=50, p=0.9),
           "min_p": dict(mp=0.05), "top_k+top_p+min_p": dict(k=50, p=0.9, mp=0.05)}


def _setup(B, V, f):
    def setup(device):
        # LLM-like logits: a heavy head over a flat body, so that top-p supports are realistic.
        x = torch.randn(B, V, device=device) * 2.0
        x[:, :200] += torch.rand(B, 200, device=device) * 8
        full = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt, device=device)  # noqa: E731
        return dict(x=x, T=full(0.8), k=full(f.get("k", 0), torch.int32), p=full(f.get("p", 1.0)),
                    mp=full(f.get("mp", 0.0)), seeds=torch.arange(B, device=device) + 1,
                    pos=torch.arange(B, device=device))

    return setup


def _args(inp):
    return inp["x"], inp["T"], inp["k"], inp["p"], inp["mp"], inp["seeds"], inp["pos"]


def _backend(name, entry="sample"):
    def make(inp):
        fn = registry.get("sampling", name).fn(entry)
        args = _args(inp)
        return lambda: fn(*args)

    return make


def _race_unfiltered(inp):
    x, T = inp["x"], inp["T"]

    def run():
        probs = torch.softmax(x / T[:, None], -1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(), -1)

    return run


def _ours_config(block=None, warps=None, bracket=True, ahead=True):
    def make(inp):
        # loads the Triton kernels (collecting the cases loads none)
        from opmap.kernels.sampling.sampler import sample

        cfg = (block, warps) if block else None
        return lambda: sample(*_args(inp), config=cfg, bracket=bracket, ahead=ahead)

    return make


def _flashinfer_from_probs(inp):
    """FlashInfer's joint top-k + top-p kernel alone, from probabilities computed outside the timed
    call: what FlashInfer's own figures time. Every other row here starts
    from logits (temperature, softmax and the checks included), so this row is the kernel's lower
    bound, not a like-for-like engine step."""
    # optional: flashinfer
    import flashinfer.sampling as fs

    _, probs, _, _ = filtered_probs(inp["x"], inp["T"], inp["k"])
    k, p = inp["k"].to(torch.int32), inp["p"]
    return lambda: fs.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint")


def _flashinfer_ok():
    return registry.all_of(registry.needs_cuda, registry.package_available("flashinfer"))()


def _penalties(B, V):
    def setup(device):
        return dict(x=torch.randn(B, V, device=device), pm=torch.rand(B, V, device=device) < 0.01,
                    cnt=(torch.rand(B, V, device=device) < 0.002).int(), rep=torch.full((B,), 1.1, device=device),
                    fr=torch.full((B,), 0.2, device=device), pr=torch.full((B,), 0.1, device=device))

    return setup


def _pen(name):
    def make(inp):
        fn = registry.get("logits", name).fn("apply_penalties")
        return lambda: fn(inp["x"], inp["pm"], inp["cnt"], inp["rep"], inp["fr"], inp["pr"])

    return make


def cases(quick: bool) -> list[BenchCase]:
    arch = hw.local_arch()
    out = []
    for V in VOCABS:
        for B in BATCHES:
            for fname, f in FILTERS.items():
                if quick and not (V == 128256 and (B == 64 or fname == "top_k+top_p")):
                    continue
                spec = SamplingSpec(arch=arch, vocab=V, dtype="fp32", top_k="k" in f, top_p="p" in f,
                                    min_p="mp" in f, seeded=False, batch_invariant=False)
                providers = [Provider("opmap-triton", _backend("triton"), backend=("sampling", "triton")),
                             Provider("torch-sort", _backend("torch-sort"), backend=("sampling", "torch-sort")),
                             Provider("torch-race", _backend("torch-race"), backend=("sampling", "torch-race")),
                             Provider("flashinfer", _backend("flashinfer"), backend=("sampling", "flashinfer"))]
                if f:
                    providers.append(Provider("torch-race-unfiltered", _race_unfiltered))
                    if V == 128256 and B in (1, 64):
                        # Passes B and C (histogram bracket, spread gather) against the per-row
                        # search from the whole row that they replace, in the same run.
                        providers.append(Provider("opmap-triton[no B/C]", _ours_config(bracket=False)))
                        # Passes A, B and C with one block in flight
                        # against the default's next block loaded ahead, in the same run.
                        providers.append(Provider("opmap-triton[ahead=0]", _ours_config(ahead=False)))
                    if not quick and V == 128256 and B == 64:
                        # The per-row search runs one program per row, and each of its passes over
                        # a 0.5 MB row runs far below one SM's L2 bandwidth (docs/sampling.md,
                        # Decisions: the per-row kernel at 16 warps), so the program's width is the other thing to vary
                        # (what passes B and C leave to it: top-p rows over 2048 tokens). The sm90
                        # build has no async copies in those loops; (8192, 16) and (8192, 32) have
                        # a 360-byte stack frame (128 and 64 registers).
                        providers += [Provider(f"opmap-triton[bl={bl},w={w}]", _ours_config(bl, w))
                                      for bl, w in ((8192, 16), (8192, 32), (4096, 16), (2048, 8), (1024, 4))]  # (2048, 16): the default
                if fname == "top_k+top_p":
                    providers.append(Provider("flashinfer-joint", _backend("flashinfer", "sample_joint"),
                                              available=_flashinfer_ok))
                    providers.append(Provider("flashinfer-joint[from probs]", _flashinfer_from_probs,
                                              available=_flashinfer_ok))
                out.append(BenchCase(op="sampling", case=f"B={B},vocab={V},filter={fname},dtype=fp32",
                                     flops=4.0 * B * V, bytes=4.0 * B * V + 40.0 * B, setup=_setup(B, V, f),
                                     providers=providers, spec=spec, tags=("sampling",),
                                     # GPU time, by graph replay: timed eagerly, the host cost of the
                                     # sampler's five launches is most of a B=1 call (docs/sampling.md,
                                     # Decisions: the sampler timed by CUDA-graph replay), which an engine hides behind
                                     # the forward pass or captures. A peer that syncs is timed
                                     # eagerly instead, with a note (harness/bench/timing.py).
                                     graph=True))
    for B in ((64,) if quick else (1, 64, 256)):
        V = 128256
        out.append(BenchCase(op="logits", case=f"penalties,B={B},vocab={V},dtype=fp32", flops=6.0 * B * V,
                             bytes=B * V * (4 + 4 + 1 + 4.0), setup=_penalties(B, V),
                             providers=[Provider("opmap-triton", _pen("triton"), backend=("logits", "triton")),
                                        Provider("torch", _pen("reference"), backend=("logits", "reference"))],
                             spec=LogitsSpec(arch=arch, vocab=V, penalties=True), tags=("sampling",)))
    return out
