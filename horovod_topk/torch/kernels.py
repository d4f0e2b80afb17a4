"""Loads the fused CPU kernels (csrc/: compress and decompress in topk_kernels.cpp, the sparse allreduce's
arithmetic in sparse_rounds.cpp, the fp16 route's pass in half_route.cpp), compiling them once per machine into one
module.

Compiled with torch's own C++ extension builder into its cache (~/.cache/torch_extensions), so the kernel always
matches the installed torch; scripts/setup.sh builds it at install time so that training never waits for the
compiler. When no compiler is available the pure-torch selector is used instead, with a warning: slower, same
results up to ties.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
from types import ModuleType
from typing import Optional

__all__ = ["load", "load_in_background", "remove_stale_lock"]

#: A build lock older than this was left by a process killed while compiling (one compile takes about a minute
#: here): torch's builder would wait on it forever, so every later training job would hang in its first step.
STALE_LOCK_SECONDS = 15 * 60

_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("topk_kernels.cpp", "sparse_rounds.cpp", "half_route.cpp")]
_NAME = "horovod_topk_kernels"
_module: Optional[ModuleType] = None
_failed = False
#: One load at a time: a step's first compress waits here for a load the background thread started.
_loading = threading.Lock()
_background: Optional[threading.Thread] = None


def _forked() -> None:
    """A process forked while the background load ran (a DataLoader's workers) has the lock held by a thread it
    does not have: its own load must not wait for it."""
    global _loading, _background
    _loading = threading.Lock()
    _background = None


os.register_at_fork(after_in_child=_forked)


def remove_stale_lock(build_dir: str, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir/lock`` when it is older than ``max_age`` seconds; True when one was removed."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return False
    if age <= max_age:
        return False
    try:
        os.remove(lock)
    except OSError:
        return False
    warnings.warn(f"horovod-topk: removed a build lock {age / 60:.0f} minutes old ({lock}), left by a process "
                  f"killed while compiling the kernels", stacklevel=3)
    return True


def load(verbose: bool = False) -> Optional[ModuleType]:
    """The compiled kernel module, or None (after one warning) when it cannot be built here."""
    if _module is not None or _failed:
        return _module
    with _loading:
        if _module is None and not _failed:
            _build(verbose)
    return _module


def _build(verbose: bool) -> None:
    global _module, _failed
    # pip installs the ninja binary next to the interpreter; make it findable even without an activated venv
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import _get_build_directory, load as build

        remove_stale_lock(_get_build_directory(_NAME, verbose=False))
        _module = build(name=_NAME, sources=_SOURCES, extra_cflags=["-O3"], verbose=verbose)
    except Exception as exc:  # no compiler, no ninja, read-only cache...: fall back, loudly
        _failed = True
        warnings.warn(f"horovod-topk: could not build the fused kernels ({exc}); using the slower pure-torch "
                      f"paths instead (the sampled selector, the sparse allreduce's arithmetic): same results",
                      stacklevel=3)


def load_in_background() -> None:
    """Start :func:`load` on a daemon thread when the module is built already, and return at once.

    Why: loading imports torch's extension builder (and setuptools with it), hashes the sources and opens the
    module: 100-270 ms of host time, measured per process on 4 workers sharing 2 cores, that the first compressed
    step (ratio="auto": the first decision's timed selection) would otherwise wait for. A compressor starts it when
    it is built, so it overlaps the model's setup and, with ratio="auto", the dense first steps, which wait on the
    link. A module not built yet is left to the first step (compiling takes a minute; a daemon thread killed at exit
    would leave the build half done); a later :func:`load` waits for this one to finish."""
    global _background
    if _module is not None or _failed or _background is not None:
        return
    _background = threading.Thread(target=_load_if_built, name="horovod-topk-kernels", daemon=True)
    _background.start()


def _load_if_built() -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = os.path.getmtime(os.path.join(_get_build_directory(_NAME, verbose=False), _NAME + ".so"))
        current = built >= max(os.path.getmtime(source) for source in _SOURCES)
    except Exception:  # not built (or not readable): the first step's load builds it, or reports what is wrong
        return
    if current:  # sources edited since the build would compile again here: left to the first step as well
        load()


def _finish_background_load() -> None:
    """At exit, let a background load finish: one that went on to compile (torch's builder decides by a hash of
    more than the sources) and was killed with the process would leave its build lock for the next job."""
    if _background is not None:
        _background.join()


atexit.register(_finish_background_load)
