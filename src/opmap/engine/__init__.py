"""The offline engine: ``LLM(model).generate(prompts, SamplingParams(...))`` over opmap operators
(resolved through the selector), with paged KV, continuous batching, chunked prefill, prefix
caching, preemption and decode CUDA graphs. ``add_run_parser`` / ``add_profile_parser`` give the
``opmap run`` / ``opmap profile`` sub-commands (functions ``cli_run`` / ``cli_profile``)."""
from .cli import add_profile_parser, add_run_parser, cli_profile, cli_run  # noqa: F401


def __getattr__(name):
    # LLM pulls in torch and the op registry: imported on first use, not with the CLI.
    if name in ("LLM", "RequestOutput"):
        from . import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from ..ops.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
