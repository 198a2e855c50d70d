"""`import grpo_fast` stays light and the native extension is built."""

import subprocess
import sys


def test_import_is_light():
    code = (
        "import sys, grpo_fast\n"
        "heavy = [m for m in ('vllm', 'transformers', 'triton', 'trl', 'liger_kernel', 'grpo_fast._C') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_native_extension_is_built():
    from grpo_fast import _C

    assert callable(_C.row_stats) and callable(_C.row_grad_)
