import os

import pytest
import torch

# Triton kernels run through the interpreter on a machine without a GPU. It must be set before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # Triton's interpreter (3.6) turns a one-element array into an index with int(array), which
    # NumPy deprecates: one warning per kernel argument read that way, in every interpreted test.
    # Its own code, not ours: filtered where it is raised, so that any other warning stands out.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:"
                                              "DeprecationWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
