# Sourced by docker/build.sh and docker/run_digits.sh (or by hand, before running podman yourself): makes rootful
# podman usable on a plain Debian 12 machine with no container registry and no Docker engine.
#   - installs podman, runc and debootstrap when they are missing (apt-get update first: fresh machines have no
#     package lists);
#   - writes a containers.conf for this machine and exports CONTAINERS_CONF, so every podman command after this
#     (build, run, exec) uses it (`source docker/podman-env.sh` before running podman by hand):
#       runtime runc: podman's default runtime crun fails on cgroup v1 hosts ("cgroups in hybrid mode not supported");
#       ulimits: rootful podman raises RLIMIT_NOFILE and RLIMIT_NPROC above the host's hard limits by default, which
#         fails where root lacks CAP_SYS_RESOURCE (Firecracker VMs, some CI runners); we ask for at most the host's own
#         hard limits, and for NPROC at most 32768 (runc refused anything above that on the machine this was made on,
#         even below its hard limit of 96364);
#       cgroupfs and a file event log: there is no systemd (or journald) to manage cgroups or take events in a VM or CI
#         container.
# Stops with a message naming the problem when podman cannot be used here.
# shellcheck shell=bash

podman_die() { echo "podman-env: $*" >&2; exit 2; }

[[ $(id -u) -eq 0 ]] || podman_die "needs root: debootstrap and rootful podman (rootless podman needs subuid ranges \
and a user session this set-up does not assume); run as root or with sudo"

_need=()
command -v podman >/dev/null 2>&1 || _need+=(podman)
command -v runc >/dev/null 2>&1 || _need+=(runc)
command -v debootstrap >/dev/null 2>&1 || _need+=(debootstrap)
if ((${#_need[@]})); then
  command -v apt-get >/dev/null 2>&1 || podman_die "missing ${_need[*]} and no apt-get to install them (this needs Debian 12 or alike)"
  echo "podman-env: installing ${_need[*]}" >&2
  apt-get update -qq || podman_die "apt-get update failed: the Debian archive is not reachable"
  # with podman's recommended packages: its container network (netavark, aardvark-dns) comes with them
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${_need[@]}" >/dev/null \
    || podman_die "could not install ${_need[*]} with apt-get"
fi
unset _need

# State outside the repository: the generated containers.conf, and docker/build.sh's debootstrap directory.
PODMAN_STATE="${HOROVOD_TOPK_PODMAN_DIR:-/var/tmp/horovod-topk-podman}"
mkdir -p "$PODMAN_STATE"
_nofile=$(ulimit -Hn); [[ "$_nofile" == unlimited || "$_nofile" -gt 65536 ]] && _nofile=65536
_nproc=$(ulimit -Hu); [[ "$_nproc" == unlimited || "$_nproc" -gt 32768 ]] && _nproc=32768
cat >"$PODMAN_STATE/containers.conf" <<CONF
# written by docker/podman-env.sh; see there why
[containers]
default_ulimits = ["nofile=$_nofile:$_nofile", "nproc=$_nproc:$_nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
# podman build's RUN steps take the runtime and the ulimits from it too
export CONTAINERS_CONF="$PODMAN_STATE/containers.conf"
unset _nofile _nproc

podman info >/dev/null 2>"$PODMAN_STATE/podman-info.err" \
  || podman_die "podman does not work here ('podman info' failed: $(tail -n 3 "$PODMAN_STATE/podman-info.err"))"
