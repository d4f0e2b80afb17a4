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
            for name in ("topk_kernels.cpp", "sparse_rounds.cpp", "half_route.cpp", "int8_route.cpp")]
_NAME = "horovod_topk_kernels"
_module: Optional[ModuleType] = None
_failed = False
#: One load at a time: a step's first compress waits here for a load the background thread started.
_loading = threading.Lock()
_background: Optional[threading.Thread] = None
#: A failure met on the background thread, warned about by the next load() on a caller's thread (a warning raised
#: on the thread would point at no user code and escape the caller's warning filters).
_unreported: Optional[str] = None
#: How long an exit or a fork waits for a background load: a load takes ~0.1-0.3 s; one that went on to compile
#: (which the checks of _load_if_built make rare) takes about a minute.
EXIT_WAIT_SECONDS = 120.0
FORK_WAIT_SECONDS = 10.0


def _before_fork() -> None:
    """Let a background load finish before a fork (a DataLoader's workers): a child forked while the thread held
    the import locks of torch's extension builder would block on its first import of it."""
    if _background is not None and _background is not threading.current_thread():
        _background.join(FORK_WAIT_SECONDS)


def _forked() -> None:
    """A child forked while the background load still ran has its lock held by a thread it does not have: its own
    load must not wait for it."""
    global _loading, _background
    _loading = threading.Lock()
    _background = None


os.register_at_fork(before=_before_fork, after_in_child=_forked)


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
    global _unreported
    if _module is None and not _failed:
        with _loading:
            if _module is None and not _failed:
                _build(verbose)
    if _unreported is not None and threading.current_thread() is not _background:
        message, _unreported = _unreported, None
        warnings.warn(message, stacklevel=2)
    return _module


def _ninja_on_path() -> None:
    """pip installs the ninja binary next to the interpreter: make it findable even without an activated venv
    (called on the caller's thread: the environment is not written while other threads may read it)."""
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _build(verbose: bool) -> None:
    global _module, _failed, _unreported
    if threading.current_thread() is not _background:
        _ninja_on_path()
    try:
        from torch.utils.cpp_extension import _get_build_directory, load as build

        remove_stale_lock(_get_build_directory(_NAME, verbose=False))
        # -fno-trapping-math: no floating-point trap is ever enabled here, and it lets the compiler turn the
        # kernels' selects into vector blends (the int8 route's pass vectorises only then); results are unchanged
        # (no reassociation, unlike -ffast-math)
        _module = build(name=_NAME, sources=_SOURCES, extra_cflags=["-O3", "-fno-trapping-math"], verbose=verbose)
    except Exception as exc:  # no compiler, no ninja, read-only cache...: fall back, loudly
        _failed = True
        _unreported = (f"horovod-topk: could not build the fused kernels ({exc}); using the slower pure-torch "
                       f"paths instead (the sampled selector, the sparse allreduce's arithmetic): same results")


def load_in_background() -> None:
    """Start :func:`load` on a daemon thread when the module is built already, and return at once.

    Why: loading imports torch's extension builder (and setuptools with it), hashes the sources and opens the
    module: 100-270 ms of host time, measured per process on 4 workers sharing 2 cores, that the first compressed
    step (ratio="auto": the first decision's timed selection) would otherwise wait for. A compressor starts it when
    it is built, so it overlaps the model's setup and, with ratio="auto", the dense first steps, which wait on the
    link. A module that would be compiled (not built yet, or built from other sources) is left to the first step:
    compiling takes a minute, and a daemon thread killed at exit would leave its build lock for the next job. A
    later :func:`load` waits for this one to finish."""
    global _background
    if _module is not None or _failed or _background is not None:
        return
    _ninja_on_path()
    _background = threading.Thread(target=_load_if_built, name="horovod-topk-kernels", daemon=True)
    _background.start()


def _load_if_built() -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = _get_build_directory(_NAME, verbose=False)
        built = os.path.getmtime(os.path.join(build_dir, _NAME + ".so"))
        with open(os.path.join(build_dir, "build.ninja")) as recipe:
            text = recipe.read()
    except Exception:  # not built (or not readable): the first step's load builds it, or reports what is wrong
        return
    # built from these very sources (another checkout sharing the cache writes its own paths) and after their last
    # edit: torch's builder then only opens the module
    if all(source in text for source in _SOURCES) and built >= max(os.path.getmtime(source) for source in _SOURCES):
        load()


def _finish_background_load() -> None:
    """At exit, give a background load time to finish: one that went on to compile anyway (torch's builder also
    decides by its own headers and flags) and was killed with the process would leave its build lock behind."""
    if _background is not None:
        _background.join(EXIT_WAIT_SECONDS)


atexit.register(_finish_background_load)
