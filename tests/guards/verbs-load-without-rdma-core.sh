#!/usr/bin/env bash
# Guard: a library using the `ib` table loads on a host WITHOUT rdma-core and reports
# "no IB device". rdma-core is hidden in a private mount namespace (`unshare -m`) by an overlay
# over the library directory whose upper layer holds whiteouts for libibverbs*, librdmacm* and
# the provider directory; the host itself is never modified.
#
# Three runs of the ib_probe cdylib (loaded with python ctypes, as NCCL would dlopen a plugin):
#   1. as is: libibverbs loads, 0 ports (no kernel RDMA here) — the library is really there;
#   2. rdma-core hidden: dlopen(libibverbs.so.1) fails, the probe still loads and returns -2
#      ("no IB device");
#   3. rdma-core hidden, NCCL_WASM_IBVERBS_PATH = the soft-ibverbs cdylib: the same probe finds
#      the soft devices — so run 2's answer is the probe working, not the probe being broken.
# The plugin library (target/debug/libnccl_net_wasm.so, built here, or $PLUGIN): run 2 also
# dlopens it and checks that ncclNetPlugin_v8 resolves.
# Needs root (mount namespace, overlayfs); prints SKIP and exits 0 otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null || ! command -v python3 >/dev/null; then
    echo "SKIP: needs root, unshare and python3"
    exit 0
fi
real=$(readlink -f "$(ldconfig -p | awk '/libibverbs\.so\.1 /{print $NF; exit}')" 2>/dev/null || true)
if [ -z "$real" ]; then
    echo "note: rdma-core is not installed here; run 1 will also report no library"
    libdir=/usr/lib/x86_64-linux-gnu
else
    libdir=$(dirname "$real")
fi

# The build `cargo test --workspace` did (same features: a `-p` build would rebuild the
# dependencies a second time); it also puts the shared libraries under target/debug/.
cargo build -q --workspace --all-targets
probe=$root/target/debug/examples/libib_probe.so
soft=$root/target/debug/libsoft_ibverbs.so
plugin=${PLUGIN:-$root/target/debug/libnccl_net_wasm.so}

run_probe() { # $1 = expectation: zero | unavailable | some
    python3 - "$probe" "$1" <<'PY'
import ctypes, sys
probe, want = sys.argv[1], sys.argv[2]
try:
    ctypes.CDLL("libibverbs.so.1")
    print("  libibverbs.so.1: loadable")
except OSError as e:
    print(f"  libibverbs.so.1: not loadable ({e})")
n = ctypes.CDLL(probe).ncclwasm_probe_ports()
ok = {"zero": n == 0, "unavailable": n == -2, "some": n > 0}[want]
print(f"  probe loaded; ncclwasm_probe_ports() = {n} (expected {want}): {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
}

echo "run 1: host as is ($libdir)"
if [ -n "$real" ]; then run_probe zero; else run_probe unavailable; fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/upper" "$tmp/work"
export -f run_probe
export probe soft libdir tmp plugin
unshare -m bash -euo pipefail -c '
    mount --make-rprivate /
    hidden=""
    for f in "$libdir"/libibverbs.so* "$libdir"/librdmacm.so* "$libdir"/libibverbs; do
        [ -e "$f" ] || continue
        mknod "$tmp/upper/$(basename "$f")" c 0 0
        hidden="$hidden $(basename "$f")"
    done
    mount -t overlay overlay -o "lowerdir=$libdir,upperdir=$tmp/upper,workdir=$tmp/work" "$libdir"
    echo "run 2: private mount namespace, hidden in $libdir:$hidden"
    run_probe unavailable
    if [ -f "$plugin" ]; then
        python3 -c "import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); l.ncclNetPlugin_v8; print(\"  plugin \" + sys.argv[1] + \" loads; ncclNetPlugin_v8 resolves: ok\")" "$plugin"
    else
        echo "  note: $plugin not built; only the probe was loaded"
    fi
    echo "run 3: same namespace, NCCL_WASM_IBVERBS_PATH=$soft"
    NCCL_WASM_IBVERBS_PATH=$soft run_probe some
'
echo "ok: a library using the ib table loads without rdma-core and reports no IB device"
