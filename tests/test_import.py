import subprocess
import sys


def test_import_needs_neither_triton_nor_cuda():
    code = (
        "import sys, lowbit\n"
        "lowbit.quantize; lowbit.load_model; lowbit.get_recipe('rtn')\n"
        "import lowbit.cli, lowbit.eval.evaluate, lowbit.formats\n"
        "import torch\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_quantize_stays_a_function_after_every_submodule_is_imported(tiny_model_dir):
    """Importing a submodule sets the package attribute of its name: no lazy name may be one."""
    import importlib
    import pkgutil

    import lowbit
    from lowbit.models.loader import load_model

    submodules = {info.name for info in pkgutil.iter_modules(lowbit.__path__)}
    assert not submodules & set(lowbit._LAZY), "a lazy top-level name is also a submodule"
    for name in sorted(submodules - {"__main__"}):
        importlib.import_module(f"lowbit.{name}")
    import lowbit.api  # noqa: F401  (the path tests and the CLI import it by)

    for _ in range(2):
        model = load_model(str(tiny_model_dir)).model
        assert callable(lowbit.quantize)
        lowbit.quantize(model, "rtn", progress=False)
        assert model.lowbit_recipe.method == "rtn"
    for name in lowbit._LAZY:
        assert getattr(lowbit, name) is getattr(importlib.import_module(lowbit._LAZY[name]), name)
