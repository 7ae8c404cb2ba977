"""The profiler view. ``engine``: opmap's own engine under torch.profiler (``opmap profile
--model``); ``trace``, ``symbols``, ``analyze``, ``plot``: any engine's trace (``opmap profile
--trace FILE``: a PyTorch profiler Chrome trace or an Nsight Systems SQLite export), attributed to
the operator map."""
from .engine import (CATEGORIES, analyse, categorize, diagnose, format_kernels, format_profile,  # noqa: F401
                     phase_backends, profile_engine, quant_lines, report_summary)
from .symbols import OP_CATEGORY  # noqa: F401
