"""lowbit.mapped: the resident pages of memory-mapped weights given back, never a changed value."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.mapped import file_mappings, release_pages, release_unused_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/pagemap").exists(),
    reason="needs Linux's /proc/self/pagemap",
)
MIB = 1 << 20


def _mapped(tmp_path) -> dict[str, torch.Tensor]:
    """Two 8 MiB tensors and a small one, as views of a memory-mapped safetensors file, read
    once (resident)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(2 * MIB, generator=gen),
        "other": torch.randn(2 * MIB, generator=gen),
        "small": torch.randn(100, generator=gen),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        loaded = {k: f.get_tensor(k) for k in f.keys()}
    assert any(m.path.endswith("w.safetensors") for m in file_mappings())  # views, not copies
    for key, tensor in loaded.items():
        assert torch.equal(tensor, tensors[key])  # reads every page
    return loaded


def test_released_pages_read_back_the_same(tmp_path):
    loaded = _mapped(tmp_path)
    expected = {k: t.clone() for k, t in loaded.items()}
    released = release_pages([loaded["big"]])
    assert 8 * MIB - 8192 <= released <= 8 * MIB  # every whole page of it
    assert release_pages([loaded["big"]]) == 0  # not resident any more
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)  # faulted in from the file
    half = release_pages([loaded["other"]], keep=[loaded["other"][:MIB]])
    assert 4 * MIB - 8192 <= half <= 4 * MIB
    assert release_pages([torch.ones(MIB)]) == 0  # not a file mapping: left alone


def test_a_page_written_since_it_was_read_is_never_dropped(tmp_path):
    loaded = _mapped(tmp_path)
    big = loaded["big"]
    big[: 4 * MIB // 4] = 7.0  # half of it written: private copies of those pages
    released = release_pages([big])
    assert released <= 4 * MIB  # only the clean half
    assert (big[:MIB] == 7.0).all()  # the written values are still there


def test_pages_no_tensor_in_use_lies_on_are_dropped(tmp_path):
    loaded = _mapped(tmp_path)
    expected = loaded["small"].clone()
    released = release_unused_pages([loaded["small"]])
    assert 16 * MIB - 3 * 4096 <= released <= 16 * MIB + 4096
    assert torch.equal(loaded["small"], expected)
    assert release_unused_pages([torch.ones(3)]) == 0  # in no mapping: nothing to look at
