"""The offline engine: ``LLM(model).generate(prompts, SamplingParams(...))`` over opmap operators
(resolved through the selector), with paged KV, continuous batching, chunked prefill, prefix
caching, preemption and decode CUDA graphs."""


def __getattr__(name):
    if name in ("LLM", "RequestOutput"):
        # the whole engine (torch, the op registry), on first use: the CLI imports this package at start
        from opmap.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        # on first use too, so that importing engine.config loads no other engine module
        from opmap.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
