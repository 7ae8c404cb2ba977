"""The profiler view. ``engine``: opmap's own engine under torch.profiler (``opmap profile
--model``); ``trace``, ``symbols``, ``analyze``, ``plot``: any engine's trace (``opmap profile
--trace FILE``: a PyTorch profiler Chrome trace or an Nsight Systems SQLite export), attributed to
the operator map."""
from opmap.harness.profile.engine import (CATEGORIES, analyse, categorize, diagnose, format_host_ops, format_kernels,  # noqa: F401
                     format_profile, phase_backends, profile_engine, python_hotspots, quant_lines, report_summary)
from opmap.harness.profile.symbols import OP_CATEGORY  # noqa: F401
