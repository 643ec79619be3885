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
