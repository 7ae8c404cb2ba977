"""StepAudit (engine/audit.py) counts the host synchronisations PyTorch reports and the kernel
compilations inside an engine's steps, by phase. Here on the CPU: a run has none, and events
raised inside a step (a sync warning, Triton's post-compile hook) land in that step's phase;
the H200 run of a real engine is tests/gpu/test_engine_gpu.py."""
import warnings

import triton

from opmap.engine.audit import StepAudit
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams
from opmap.model.presets import get_preset


def test_audit_counts_events_inside_steps_by_phase():
    llm = LLM(get_preset("tiny-llama3"), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, seed=0)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with StepAudit(llm) as audit:
        outs = llm.generate([[1, 2, 3, 4], [5, 6]], params)
    assert all(len(o.token_ids) == 3 for o in outs)
    assert audit.counts() == {}, audit.events  # the CPU engine neither syncs nor compiles in its steps

    execute = llm._execute

    def noisy(batch, pend=None):
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning,
                               "/site-packages/flashinfer/prefill.py", 7)  # a declared site
        triton.knobs.runtime.jit_post_compile_hook(fn=noisy)  # what Triton calls after a build
        return execute(batch, pend)

    llm._execute = noisy
    with StepAudit(llm) as audit:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    got = audit.counts()
    two = {"syncs": 2, "compiles": 1}
    assert got == {"prefill": two, "decode": two}, audit.events  # 2 tokens: one prefill, one decode step
    assert len(audit.undeclared()) == 4 and all("flashinfer" not in w for _, _, w in audit.undeclared())
    assert audit.declared_per_site() == {("prefill", "/site-packages/flashinfer/prefill.py:7"): 1,
                                         ("decode", "/site-packages/flashinfer/prefill.py:7"): 1}
    assert ("prefill", "compile", "noisy") in audit.events
    assert llm._execute is noisy and triton.knobs.runtime.jit_post_compile_hook is None  # restored


def test_compile_events_name_the_kernel():
    """Triton's hooks pass ``fn`` as a JitFunctionInfo (``.name``), not the function itself."""
    from triton.runtime.jit import JitFunctionInfo

    from opmap.engine.audit import kernel_name

    assert kernel_name(JitFunctionInfo(None, "_prefill_kernel", None)) == "_prefill_kernel"
    assert kernel_name(test_compile_events_name_the_kernel) == "test_compile_events_name_the_kernel"
