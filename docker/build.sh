#!/usr/bin/env bash
# Builds the CPU image (docker/Dockerfile.cpu) with podman on a machine that reaches no container registry:
#   1. a Debian 12 (bookworm) base made here with debootstrap from the Debian archive -- Python 3.11 with venv and
#      headers, as in the public python:3.11-slim-bookworm the Dockerfile names by default -- imported into podman
#      as localhost/horovod-topk-base:bookworm (skipped when that image exists; REBUILD_BASE=1 remakes it);
#   2. docker/Dockerfile.cpu built on that base (build argument BASE), the set-up inside being scripts/setup.sh;
#      then `horovodrun --check-build` in the image.
#
#   usage: bash docker/build.sh            (as root; installs podman, runc and debootstrap when missing)
#
# What the build takes from the host, and why:
#   - the Debian archive (DEBIAN_MIRROR, default http://deb.debian.org/debian): the base, and the packages the
#     Dockerfile and scripts/setup.sh install (OpenMPI, cmake, g++, sshd);
#   - PyPI: tensorflow-cpu, Horovod's source and the rest of scripts/setup.sh's packages. The build uses the host's
#     network (--network host), so a host that reaches PyPI only through its own resolver or proxy works too;
#   - the host's CA bundle (HOST_CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt), mounted read-only at
#     /tmp/host/ca-certificates.crt and given to pip as its cert: where HTTPS leaves the machine through a
#     TLS-intercepting proxy, only the host's own trust store knows the proxy's certificate authority, and pip in the
#     build would refuse PyPI without it;
#   - the torch 2.13.0 CPU wheel from the directory TORCH_WHEELS (default /opt/wheels), mounted read-only at
#     /tmp/host/wheels and given to pip as find-links: PyPI's Linux torch is a CUDA build of several GB, and
#     PyTorch's CPU wheel index (the Dockerfile's TORCH_INDEX_URL) may be unreachable. Without such a wheel on the
#     host, pip takes torch from that index;
#   - the Horovod wheel cache, HOROVOD_TOPK_CACHE (default ~/.cache/horovod-topk), mounted read-write at the
#     container's own cache path: scripts/setup.sh compiles Horovod (about 10 minutes on 2 cores) only when no
#     wheel there matches its key (Python, torch, TensorFlow and OpenMPI versions, scripts/build_horovod.sh), and
#     leaves the wheel it built there, so the next image build reuses it.
# None of these files ends up in the image (their mount points stay, empty).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/docker/podman-env.sh"

IMAGE="${IMAGE:-localhost/horovod-topk:cpu}"
BASE_IMAGE="${BASE_IMAGE:-localhost/horovod-topk-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
HOST_CA_BUNDLE="${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
CACHE="${HOROVOD_TOPK_CACHE:-$HOME/.cache/horovod-topk}"
log() { printf '[docker/build] %s\n' "$*" >&2; }
die() { log "$*"; exit 2; }
now() { date +%s; }

# ---- 1. the base ----------------------------------------------------------------------------------------------
if [[ -n "${REBUILD_BASE:-}" ]] || ! podman image exists "$BASE_IMAGE"; then
  rootfs="$PODMAN_STATE/rootfs"
  rm -rf "$rootfs"
  log "debootstrap: Debian 12 (bookworm) from $DEBIAN_MIRROR into $rootfs"
  t0=$(now)
  # minbase: dpkg, apt and essential packages only; Python as the public python:3.11-slim-bookworm has it (venv to
  # make the image's virtual environment, headers for compiling Horovod), and certificates for pip's HTTPS.
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$rootfs" "$DEBIAN_MIRROR" >"$PODMAN_STATE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$PODMAN_STATE/debootstrap.log" >&2; die "debootstrap failed (log: $PODMAN_STATE/debootstrap.log)"; }
  # debootstrap writes the release suite alone; updates and security fixes as in Debian's own images
  security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
  cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb $security bookworm-security main
SOURCES
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
  log "debootstrap took $(($(now) - t0)) s; importing as $BASE_IMAGE"
  tar -C "$rootfs" --numeric-owner -cf - . \
    | podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" \
      >"$PODMAN_STATE/import.log" 2>&1 || { cat "$PODMAN_STATE/import.log" >&2; die "podman import failed"; }
  rm -rf "$rootfs"
fi
# Can podman start a container here at all? Fail now, with the reason, rather than inside the build.
podman run --rm "$BASE_IMAGE" python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11)' \
  2>"$PODMAN_STATE/probe.err" \
  || die "podman cannot run a container here: $(tail -n 3 "$PODMAN_STATE/probe.err")"

# ---- 2. the image ---------------------------------------------------------------------------------------------
build_args=(--build-arg "BASE=$BASE_IMAGE")
mounts=()
if compgen -G "$TORCH_WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
  log "torch: the CPU wheel in $TORCH_WHEELS"
  mounts+=(-v "$TORCH_WHEELS:/tmp/host/wheels:ro")
  build_args+=(--build-arg PIP_FIND_LINKS=/tmp/host/wheels --build-arg TORCH_INDEX_URL=)
else
  log "torch: no torch-2.13.0+cpu wheel in $TORCH_WHEELS; pip takes it from the Dockerfile's TORCH_INDEX_URL"
fi
if [[ -f "$HOST_CA_BUNDLE" ]]; then
  mounts+=(-v "$HOST_CA_BUNDLE:/tmp/host/ca-certificates.crt:ro")
  build_args+=(--build-arg PIP_CERT=/tmp/host/ca-certificates.crt)
fi
mkdir -p "$CACHE"
mounts+=(-v "$CACHE:/root/.cache/horovod-topk")
log "building $IMAGE from docker/Dockerfile.cpu on $BASE_IMAGE (Horovod wheel cache: $CACHE)"
t0=$(now)
podman build --network host "${mounts[@]}" "${build_args[@]}" \
  -f "$ROOT/docker/Dockerfile.cpu" -t "$IMAGE" "$ROOT" \
  || die "podman build failed (its output is above)"
log "image build took $(($(now) - t0)) s"
# stderr: TensorFlow's start-up lines, printed for each framework horovodrun probes
podman run --rm "$IMAGE" horovodrun --check-build 2>/dev/null || die "horovodrun --check-build failed in $IMAGE"
log "done: $IMAGE; train on 2 workers with: bash docker/run_digits.sh"
