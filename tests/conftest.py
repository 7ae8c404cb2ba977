import os

import pytest
import torch

# Triton kernels run through the interpreter on a machine without a GPU. It must be set before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
