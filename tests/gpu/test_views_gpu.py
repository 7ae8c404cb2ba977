"""The stride / view fuzz of tests/test_views.py on the GPU, in bf16, over the compiled kernels."""
import sys
from pathlib import Path

import pytest

from opmap.core import registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_views import CASES, check_views, on  # noqa: E402

pytestmark = pytest.mark.gpu
GPU_CASES = [c for c in CASES if "triton" in c[4]]


@pytest.mark.parametrize("name,op,entry,build,backend", GPU_CASES, ids=[f"{c[0]}-{c[4]}" for c in GPU_CASES])
def test_views_match_or_are_refused_gpu(name, op, entry, build, backend):
    check_views(name, registry.get(op, backend).fn(entry), on("cuda", build), backend)
