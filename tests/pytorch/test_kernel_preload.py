"""The fused kernels start loading when a compressor is built (torch.kernels.load_in_background), in a process of
their own each: the module is loaded once, whoever asks first, and a module not built yet is never compiled on the
background thread."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, timeout: float = 300, cwd: Path = ROOT, **env: str) -> str:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def built_kernels() -> None:
    """The module built in the shared cache (scripts/setup.sh builds it), which the background load looks for."""
    from horovod_topk.torch import kernels

    if kernels.load() is None:
        pytest.skip("the fused kernels cannot be built here")


def test_building_a_compressor_loads_the_built_kernels_on_a_thread_and_a_later_load_gets_the_same_module(
        built_kernels):
    out = run("import sys\n"
              "from horovod_topk.torch import kernels\n"
              "from horovod_topk.torch import TopKEF\n"
              "from horovod_topk.torch.ddp import TopKEFState\n"
              "assert kernels._module is None and kernels._background is None\n"
              "TopKEF(ratio=0.01)\n"
              "thread = kernels._background\n"
              "assert thread is not None and thread.daemon\n"
              "module = kernels.load()\n"  # waits for the thread's load instead of loading a second time
              "thread.join(60)\n"
              "assert not thread.is_alive() and module is not None and kernels._module is module\n"
              "TopKEFState(ratio='auto')\n"
              "assert kernels._background is thread\n"  # nothing started again
              "print('ok')\n")
    assert out.strip() == "ok"


def test_kernels_not_built_yet_are_left_to_the_first_step(tmp_path):
    # an empty extension cache: the thread must neither compile (a minute, killed with the process at exit) nor
    # leave a build lock behind
    out = run("from horovod_topk.torch import kernels\n"
              "from horovod_topk.torch import TopKEF\n"
              "TopKEF(ratio='auto')\n"
              "kernels._background.join(60)\n"
              "assert not kernels._background.is_alive()\n"
              "assert kernels._module is None and not kernels._failed\n"
              "print('ok')\n", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert out.strip() == "ok"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], list(tmp_path.rglob("*"))


def test_a_process_forked_during_the_load_loads_on_its_own(built_kernels):
    # the lock held as by a background load at the moment of the fork: the child's load must not wait for a
    # thread it does not have
    out = run("import os\n"
              "from horovod_topk.torch import kernels\n"
              "kernels._loading.acquire()\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    import signal\n"
              "    signal.alarm(30)\n"  # a child waiting on the lock ends instead of hanging on
              "    os._exit(0 if kernels.load() is not None else 3)\n"
              "_, status = os.waitpid(pid, 0)\n"
              "print(os.waitstatus_to_exitcode(status))\n", timeout=60)  # a wait on the lock: a hang
    assert out.strip() == "0"


def test_another_checkouts_sources_are_left_to_the_first_step(built_kernels, tmp_path):
    # a copy of the package: the shared cache's module was built from other paths, which torch's builder would
    # compile again for these sources; the background thread must not start that
    import shutil

    shutil.copytree(ROOT / "horovod_topk", tmp_path / "horovod_topk")
    out = run("from horovod_topk.torch import kernels\n"
              "from horovod_topk.torch import TopKEF\n"
              f"assert kernels.__file__.startswith({str(tmp_path)!r}), kernels.__file__\n"
              "TopKEF(ratio=0.01)\n"
              "kernels._background.join(60)\n"
              "assert kernels._module is None and not kernels._failed\n"
              "print('ok')\n", cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert out.strip() == "ok"


def test_a_module_older_than_its_sources_is_left_to_the_first_step(tmp_path):
    # a cache whose module names these sources but was built before their last edit: torch's builder would compile
    # again; the background thread must neither do that nor write anything
    from horovod_topk.torch import kernels

    build = tmp_path / "horovod_topk_kernels"
    build.mkdir()
    (build / "build.ninja").write_text("".join(f"build x.o: compile {source}\n" for source in kernels._SOURCES))
    module = build / "horovod_topk_kernels.so"
    module.write_bytes(b"")
    os.utime(module, (0, 0))
    before = sorted(p.name for p in build.iterdir())
    out = run("from horovod_topk.torch import kernels\n"
              "from horovod_topk.torch import TopKEF\n"
              "TopKEF(ratio=0.01)\n"
              "kernels._background.join(60)\n"
              "assert kernels._module is None and not kernels._failed and kernels._unreported is None\n"
              "print('ok')\n", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert out.strip() == "ok"
    assert sorted(p.name for p in build.iterdir()) == before and module.stat().st_mtime == 0


def test_a_failure_on_the_thread_is_warned_about_once_by_the_callers_load(built_kernels):
    out = run("import warnings\n"
              "import torch.utils.cpp_extension as builder\n"
              "def broken(**_):\n"
              "    raise RuntimeError('no compiler today')\n"
              "builder.load = broken\n"
              "from horovod_topk.torch import kernels\n"
              "from horovod_topk.torch import TopKEF\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              "    TopKEF(ratio=0.01)\n"
              "    kernels._background.join(60)\n"
              "    assert kernels._failed and not caught, caught\n"  # nothing warned on the thread
              "    assert kernels.load() is None and kernels.load() is None\n"
              "assert len(caught) == 1 and 'no compiler today' in str(caught[0].message), caught\n"
              "assert caught[0].filename == '<string>', caught[0].filename\n"  # points at the caller
              "print('ok')\n")
    assert out.strip() == "ok"
