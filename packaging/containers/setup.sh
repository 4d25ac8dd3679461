#!/usr/bin/env bash
# Container engines for ColdSnap's OCI runtime shim, on Debian 12/13: install what is missing, run daemons on
# private paths, register the shim.
#
#   setup.sh install [base|podman|containerd|docker|all]...   idempotent; only missing packages are installed
#   setup.sh start-containerd DIR   containerd with its own root/state/socket under DIR; prints its pid
#   setup.sh start-containerd-cri DIR   the same with containerd's CRI plugin serving (a kubelet's containerd): the
#                                   runtime class "coldsnap" registered by `coldsnap runtime configure --runtime
#                                   containerd` alone, CNI (Debian's plugins, a bridge with addresses from
#                                   $CRI_SUBNET, default 10.77.0.0/24) and the sandbox (pause) image $PAUSE_IMAGE
#                                   under DIR; $CONTAINERD_BIN picks the binary (e.g. containerd2.sh's 2.x)
#   setup.sh stop-containerd DIR
#   setup.sh start-dockerd DIR      dockerd with DIR/daemon.json (from daemon.json here: data-root, exec-root,
#                                   pidfile, socket under DIR; runtime "coldsnap" = the venv's coldsnap-runtime)
#   setup.sh stop-dockerd DIR
#   setup.sh install-launchers [BINDIR [HOOKSDIR]]  a fast `python -S` launcher for coldsnap-runtime and a
#                                   coldsnap-hook link in BINDIR (default /usr/local/bin); the podman/CRI-O hooks
#                                   in HOOKSDIR (default /usr/share/containers/oci/hooks.d; "-": none)
# Environment: VENV (default: the repository's .venv); COLDSNAP_RUNTIME_PATH, the runtime written into
# daemon.json (default: $VENV/bin/coldsnap-runtime).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-$REPO/.venv}
case "$VENV" in /*) ;; *) VENV=$REPO/$VENV ;; esac
log() { echo "containers: $*" >&2; }

# command:package pairs per component
BASE="runc:runc iptables:iptables nft:nftables busybox:busybox-static nsenter:util-linux curl:curl"
PODMAN="podman:podman catatonit:catatonit"
CONTAINERD="containerd:containerd ctr:containerd /usr/lib/cni/bridge:containernetworking-plugins"
DOCKER="dockerd:docker.io"

have() {
    case "$1" in
        busybox) dpkg -s busybox-static >/dev/null 2>&1 ;;
        catatonit) [ -x /usr/libexec/podman/catatonit ] || [ -x /usr/bin/catatonit ] || command -v catatonit >/dev/null ;;
        *) command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ] ;;
    esac
}

install() {
    local want="" part pair missing=()
    [ $# -gt 0 ] || set -- base
    for part in "$@"; do
        case "$part" in
            base) want="$want $BASE" ;;
            podman) want="$want $BASE $PODMAN" ;;
            containerd) want="$want $BASE $CONTAINERD" ;;
            docker) want="$want $BASE $DOCKER" ;;
            all) want="$want $BASE $PODMAN $CONTAINERD $DOCKER" ;;
            *) log "unknown component $part"; exit 2 ;;
        esac
    done
    for pair in $want; do
        have "${pair%%:*}" || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    log "installing ${missing[*]}"
    # Serialise with other installers on this host (and wait for dpkg's lock). The packages' own system daemons
    # are not ours to manage: ColdSnap's run on private paths (start-containerd, start-dockerd) beside them.
    exec 9>/var/lib/apt/coldsnap-containers.lock
    flock 9
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

wait_socket() {  # path seconds
    local i
    for i in $(seq 1 $(( $2 * 10 ))); do [ -S "$1" ] && return 0; sleep 0.1; done
    log "no socket at $1 after $2 s"; return 1
}

start_containerd() {  # DIR [cri]; $CONTAINERD_BIN: the containerd binary (default: the host's)
    local dir=$1 cri=${2:-} bin=${CONTAINERD_BIN:-containerd}
    mkdir -p "$dir"
    if [ -f "$dir/containerd.pid" ] && kill -0 "$(cat "$dir/containerd.pid")" 2>/dev/null; then cat "$dir/containerd.pid"; return; fi
    # Its own shim first on PATH (a containerd from a prefix ships one).
    case "$bin" in */*) export PATH="$(dirname "$bin"):$PATH" ;; esac
    "$bin" config default >"$dir/config.toml.tmp"
    # Quotes: "…" in config version 2 (containerd 1.x), '…' in version 3 (2.x).
    sed -i -e "s|^root = .*|root = \"$dir/root\"|" -e "s|^state = .*|state = \"$dir/state\"|" \
        -e "s|address = [\"']/run/containerd/containerd.sock[\"']|address = \"$dir/containerd.sock\"|" \
        -e "s|address = [\"']/run/containerd/debug.sock[\"']|address = \"$dir/debug.sock\"|" "$dir/config.toml.tmp"
    if [ -z "$cri" ]; then
        sed -i -e "s|^\(\s*\)disabled_plugins = .*|\1disabled_plugins = [\"io.containerd.grpc.v1.cri\"]|" "$dir/config.toml.tmp"
    else
        cri_config "$dir"
    fi
    mv "$dir/config.toml.tmp" "$dir/config.toml"
    setsid "$bin" --config "$dir/config.toml" >"$dir/containerd.log" 2>&1 </dev/null &
    echo $! >"$dir/containerd.pid"
    wait_socket "$dir/containerd.sock" 30
    cat "$dir/containerd.pid"
}

cri_config() {  # DIR: CRI settings of a private node, then the runtime class as a user adds it
    local dir=$1 subnet=${CRI_SUBNET:-10.77.0.0/24} bridge=${CRI_BRIDGE:-cscri0} pause=${PAUSE_IMAGE:-localhost/coldsnap-pause:1}
    mkdir -p "$dir/cni/net.d" "$dir/cni/ipam" "$dir/pods"
    # 1.x: sandbox_image, bin_dir; 2.x: pinned_images.sandbox, bin_dirs (which list /usr/lib/cni already).
    # restrict_oom_score_adj: the sandbox asks for -998, which a host that is itself a container may not grant.
    sed -i -e "s|sandbox_image = .*|sandbox_image = \"$pause\"|" -e "s|^\(\s*\)sandbox = .*|\1sandbox = \"$pause\"|" \
        -e "s|bin_dir = \"/opt/cni/bin\"|bin_dir = \"/usr/lib/cni\"|" \
        -e "s|conf_dir = [\"']/etc/cni/net.d[\"']|conf_dir = \"$dir/cni/net.d\"|" \
        -e "s|restrict_oom_score_adj = false|restrict_oom_score_adj = true|" "$dir/config.toml.tmp"
    cat >"$dir/cni/net.d/10-coldsnap.conflist" <<CNI
{"cniVersion": "1.0.0", "name": "coldsnap-$bridge",
 "plugins": [{"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
              "ipam": {"type": "host-local", "ranges": [[{"subnet": "$subnet"}]], "dataDir": "$dir/cni/ipam"}}]}
CNI
    "$VENV/bin/coldsnap" runtime configure --runtime containerd --config "$dir/config.toml.tmp" >/dev/null
}

stop_pidfile() {  # pidfile seconds
    [ -f "$1" ] || return 0
    local pid; pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 $(( $2 * 10 ))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$1"
}

start_dockerd() {
    local dir=$1
    mkdir -p "$dir"
    if [ -f "$dir/dockerd.pid" ] && kill -0 "$(cat "$dir/dockerd.pid")" 2>/dev/null; then cat "$dir/dockerd.pid"; return; fi
    sed -e "s|@DIR@|$dir|g" -e "s|@RUNTIME@|${COLDSNAP_RUNTIME_PATH:-$VENV/bin/coldsnap-runtime}|g" \
        "$HERE/daemon.json" >"$dir/daemon.json"
    setsid /usr/sbin/dockerd --config-file "$dir/daemon.json" >"$dir/dockerd.log" 2>&1 </dev/null &
    echo $! >"$dir/dockerd.pid"
    wait_socket "$dir/docker.sock" 60
    cat "$dir/dockerd.pid"
}

install_launchers() {
    local bindir=${1:-/usr/local/bin} hooksdir=${2:-/usr/share/containers/oci/hooks.d}
    mkdir -p "$bindir"
    # `python -S` skips site (and the editable-install finder): pass-through starts in ~9 ms instead of ~23 ms.
    # The shim calls site.main() itself before it imports anything outside the stdlib.
    cat >"$bindir/coldsnap-runtime.tmp" <<LAUNCHER
#!$VENV/bin/python -S
import sys
sys.path.insert(0, "$REPO")
from coldsnap.shim.main import main
sys.exit(main())
LAUNCHER
    chmod 755 "$bindir/coldsnap-runtime.tmp"
    mv "$bindir/coldsnap-runtime.tmp" "$bindir/coldsnap-runtime"
    ln -sfn "$VENV/bin/coldsnap-hook" "$bindir/coldsnap-hook"
    log "installed $bindir/coldsnap-runtime and $bindir/coldsnap-hook"
    [ "$hooksdir" = "-" ] && return 0
    mkdir -p "$hooksdir"
    for f in "$REPO"/packaging/oci-hooks.d/*.json; do
        sed "s|/usr/local/bin/coldsnap-hook|$bindir/coldsnap-hook|" "$f" >"$hooksdir/$(basename "$f")"
    done
    log "installed the podman/CRI-O hooks in $hooksdir"
}

cmd=${1:-install}; shift || true
case "$cmd" in
    install) install "$@" ;;
    start-containerd) start_containerd "$1" ;;
    start-containerd-cri) start_containerd "$1" cri ;;
    stop-containerd) stop_pidfile "$1/containerd.pid" 20 ;;
    start-dockerd) start_dockerd "$1" ;;
    stop-dockerd) stop_pidfile "$1/dockerd.pid" 30 ;;
    install-launchers) install_launchers "$@" ;;
    *) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 2 ;;
esac
