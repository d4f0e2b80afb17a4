#!/usr/bin/env bash
# Trains the digits CNN on 2 Horovod workers in 2 containers of the CPU image (docker/build.sh), one worker per
# container, with TopKEF -- the first run of scripts/demo.sh, across containers instead of on one machine:
#   - a podman bridge network (horovod-topk) joins the containers topk-w1 and topk-w2; each runs sshd, because
#     horovodrun starts the workers of other hosts over ssh;
#   - a key pair made for the job (in the image, so the host needs no ssh) is mounted read-only as /root/.ssh in both;
#   - from topk-w1: horovodrun -np 2 -H topk-w1:1,topk-w2:1 --gloo python examples/digits_torch.py [ARGS...]
# The containers are removed at the end, the network and the key pair are kept for the next run.
#
#   usage: bash docker/run_digits.sh [--mpi] [digits_torch.py options, e.g. --dense --epochs 10]
#   (as root, after docker/build.sh; IMAGE overrides the image, localhost/horovod-topk:cpu)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/docker/podman-env.sh"

IMAGE="${IMAGE:-localhost/horovod-topk:cpu}"
NETWORK=horovod-topk
WORKERS=(topk-w1 topk-w2)
controller=--gloo
if [[ "${1:-}" == --mpi ]]; then controller=--mpi; shift; fi
log() { printf '[docker/run_digits] %s\n' "$*" >&2; }
die() { log "$*"; exit 2; }

podman image exists "$IMAGE" || die "no image $IMAGE: build it first with 'bash docker/build.sh'"

# the job's key pair: StrictHostKeyChecking off and no known_hosts file, as /root/.ssh is read-only in the containers
keys="$PODMAN_STATE/job-ssh"
if [[ ! -f "$keys/id_ed25519" ]]; then
  rm -rf "$keys"; mkdir -p "$keys"; chmod 700 "$keys"
  podman run --rm -v "$keys:/keys" "$IMAGE" ssh-keygen -q -t ed25519 -N '' -C horovod-topk-job -f /keys/id_ed25519
  cp "$keys/id_ed25519.pub" "$keys/authorized_keys"
  printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' >"$keys/config"
  chmod 600 "$keys"/*
fi

podman network exists "$NETWORK" || podman network create "$NETWORK" >/dev/null \
  || die "cannot create the podman network $NETWORK (netavark: bridge, iptables); 'podman network create $NETWORK' says why"

cleanup() { podman rm -f -t 0 "${WORKERS[@]}" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
for w in "${WORKERS[@]}"; do
  # sshd -D -e: in the foreground as the container's process, logging to its output (podman logs topk-w2)
  podman run -d --name "$w" --hostname "$w" --network "$NETWORK" -v "$keys:/root/.ssh:ro" "$IMAGE" \
    /usr/sbin/sshd -D -e >/dev/null || die "cannot start container $w"
done
# sshd needs a moment; each container must reach the other by name (aardvark-dns) before horovodrun tries
for _ in $(seq 1 30); do
  if podman exec topk-w1 ssh -o ConnectTimeout=2 topk-w2 true 2>/dev/null \
      && podman exec topk-w2 ssh -o ConnectTimeout=2 topk-w1 true 2>/dev/null; then
    break
  fi
  sleep 1
done
podman exec topk-w1 ssh -o ConnectTimeout=2 topk-w2 true \
  || die "topk-w1 cannot ssh into topk-w2 over the network $NETWORK (podman logs topk-w2 shows sshd's side)"

# TF_CPP_MIN_LOG_LEVEL: TensorFlow's start-up lines (Horovod imports it) would bury the training output;
# horovodrun forwards the launching environment to the remote worker, PATH (the image's virtual environment) included.
hvdrun=(podman exec -e TF_CPP_MIN_LOG_LEVEL=3 -e OMPI_ALLOW_RUN_AS_ROOT=1 -e OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 topk-w1
        horovodrun -np 2 -H topk-w1:1,topk-w2:1 "$controller")
log "where the workers run:"
"${hvdrun[@]}" python -c 'import socket, horovod.torch as hvd; hvd.init()
print(f"rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()}", flush=True)'
log "horovodrun -np 2 -H topk-w1:1,topk-w2:1 $controller python examples/digits_torch.py $*"
"${hvdrun[@]}" python examples/digits_torch.py "$@"
