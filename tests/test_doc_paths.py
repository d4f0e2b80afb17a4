"""Every repository path the Markdown files name exists: paths written from the repository root (``scripts/...``,
``benchmarks/...``, ``docs/...``, ``horovod_topk/...``, ``examples/...``, ``tests/...``) anywhere in the text, and
relative link targets (``[text](../benchmarks/README.md)``) from the file's own folder."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("scripts", "benchmarks", "docs", "horovod_topk", "examples", "tests")
# A path from the root: one of the prefixes, not preceded by a path or word character (so "../docs/x" and
# "github.com/x/docs/y" are not read as root paths), and ending in a word character (trailing punctuation, backticks
# and a final "/" are not part of it).
ROOT_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(PREFIXES))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files():
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every Markdown file outside the venv
        files = [p for p in ROOT.rglob("*.md") if not {".venv", ".git", "results"} & set(p.relative_to(ROOT).parts)]
    return sorted(p for p in files if p.exists())


def named_paths(path: Path):
    """(line number, the path as written, where it should be) for every path ``path`` names."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for match in ROOT_PATH.finditer(line):
            yield number, match.group(1), ROOT / match.group(1)
        for match in LINK.finditer(line):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchors and URLs
                continue
            yield number, target, (path.parent / target)


def test_there_are_markdown_files_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "benchmarks/README.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_named_exists(md):
    missing = [f"{md.relative_to(ROOT)}:{number}: {written}" for number, written, where in named_paths(md)
               if not where.exists()]
    assert not missing, "paths named in Markdown that do not exist:\n" + "\n".join(missing)


def test_the_pattern_ignores_punctuation_and_relative_paths():
    line = "see `scripts/test.sh`, scripts/demo.sh. (docs/how-it-works.md) ../docs/x.md github.com/a/docs/b"
    assert [m.group(1) for m in ROOT_PATH.finditer(line)] == ["scripts/test.sh", "scripts/demo.sh",
                                                              "docs/how-it-works.md"]
