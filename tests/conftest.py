import pytest
import torch

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where there is no CUDA device (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
