"""The core must stay framework-free: importing it in a clean interpreter loads no torch, tensorflow or numpy."""
import subprocess
import sys


def test_core_imports_no_framework():
    code = (
        "import sys, horovod_topk.core\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'numpy', 'horovod'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", f"horovod_topk.core imported: {out}"
