"""The profiler view. ``engine``: opmap's own engine under torch.profiler (``opmap profile
--model``); ``trace``, ``symbols``, ``analyze``, ``plot``: any engine's trace (``opmap profile
--trace FILE``: a PyTorch profiler Chrome trace or an Nsight Systems SQLite export), attributed to
the operator map."""
from .engine import (CATEGORIES, OP_CATEGORY, SYMBOL_RULES, analyse, categorize, diagnose,  # noqa: F401
                     format_kernels, format_profile, phase_backends, profile_engine, report_summary)
