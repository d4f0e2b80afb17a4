#!/usr/bin/env bash
# Builds the CPU image and trains the digits CNN in 2 containers (tests/test_docker_image.py), outside the default
# test run (scripts/test.sh), where that test skips: a first build takes about 17 minutes on 2 cores.
#   usage: bash docker/test_image.sh        (as root; timings of each step are printed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $(id -u) -eq 0 ]] || { echo "docker/test_image.sh: needs root (debootstrap, rootful podman)" >&2; exit 2; }
# pytest comes from the project's environment; a set-up machine returns from this in seconds
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
HOROVOD_TOPK_DOCKER_TEST=1 exec python -m pytest tests/test_docker_image.py -v -s -p no:cacheprovider --color=no "$@"
