"""The sampler kernel tests again, with the GPU's code path forced on the interpreter: pass A
split over chunks (of 256 here), the histogram bracket and the spread gather (passes B and C).
On the CPU the sampler otherwise runs one program per row with none of them, so the edge cases
(one finite logit, ties, invalid rows, top_p = 1, k = V, ...) would reach those kernels only on a GPU."""
import pytest

from test_sampling_kernel import *  # noqa: F401,F403  (the same tests, collected here again)


@pytest.fixture(autouse=True)
def gpu_chunking(monkeypatch):
    from opmap.ops.sampling import sampler

    block, cand, warps, _ = sampler._config(__import__("torch").device("cpu"))
    monkeypatch.setattr(sampler, "_config", lambda dev: (block, cand, warps, 256))
