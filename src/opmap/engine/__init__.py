"""The offline engine: ``LLM(model).generate(prompts, SamplingParams(...))`` over opmap operators
(resolved through the selector), with paged KV, continuous batching, chunked prefill, prefix
caching, preemption and decode CUDA graphs."""


def __getattr__(name):
    # LLM pulls in torch and the op registry: imported on first use.
    if name in ("LLM", "RequestOutput"):
        from opmap.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from opmap.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
