import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Without CUDA, Triton kernels run in Triton's interpreter. The choice is made when triton is
# imported (its own library functions are @jit-decorated then), and transformers imports triton
# when a model class loads, so it is set here, before any test imports either.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# `make test` runs the suite in two pytest-xdist workers, one file at a time each: a worker's
# torch (and the processes its tests start) then takes one thread, so that the two workers fill
# the two cores without their OpenMP threads waiting on each other; alone, the suite takes two
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

# gguf is a dependency of lowbit, but a GPU machine's image may lack it: its modules are not
# collected there instead of failing the collection
collect_ignore = []
if importlib.util.find_spec("gguf") is None:
    collect_ignore += ["formats/test_gguf_blocks.py", "formats/test_gguf_mix.py",
                       "io/test_gguf_export.py"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The README's files first (each runs a block of README commands, 5-10 minutes), then the
    other files with `slow` tests: under pytest-xdist the longest start while the short ones
    fill the other worker. Skip `gpu` tests where there is no CUDA device (CI has none)."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(  # stable: the order within each group kept
        key=lambda item: (not item.path.name.startswith("test_readme"), item.path not in slow_files)
    )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama with a locally trained tokenizer, saved as a Hugging Face directory."""
    from lowbit.models.tiny import save_tiny_model

    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(directory, "llama")
    return directory


@pytest.fixture(scope="session")
def load_benchmark():
    """``load(name)``: ``benchmarks/<name>.py`` as a module, kept in ``sys.modules`` (a
    dataclass of its own looks its module up there)."""

    def load(name: str):
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def embedded():
    """The real embedded model (SmolLM2-135M-Instruct), loaded once per session."""
    from lowbit.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def wikitext_path():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    return path


@pytest.fixture
def recording_compile():
    """``compile(module) -> (compiled, graphs)``: ``torch.compile`` with a backend that keeps the
    code of every FX graph dynamo hands it and runs the graph as it is (no codegen), so a test
    can count what the compiled step calls."""

    def compile_recording(module):
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm.code)
            return gm.forward

        return torch.compile(module, backend=record), graphs

    return compile_recording
