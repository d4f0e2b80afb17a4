"""Run a snippet of Python in a new interpreter: for what depends on what a process has imported, and in which
order (the routing's installation), which one test process cannot undo."""
import subprocess
import sys
import textwrap


def run_code(code: str, timeout: float = 300) -> str:
    """Run ``code`` (dedented) in a new interpreter; its stdout, after asserting it exited cleanly."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
