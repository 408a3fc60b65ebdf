#!/usr/bin/env bash
# Guard: nothing built on the verbs crate may depend on libibverbs/librdmacm/libmlx5 at link
# time. The `ib` table dlopen()s libibverbs.so.1 (and Data Direct libmlx5.so.1) at run time, so
# the plugin must load on hosts without rdma-core. Any reference to an exported rdma-sys verb or
# mlx5dv function would bring back a `NEEDED` entry; this script catches that.
#
# Checks (each printed): the ib_probe cdylib (verbs crate + ib table + discovery, built like the
# plugin), the conformance test binaries of the soft provider crate, and any extra libraries
# given as arguments (pass the plugin's .so; the script builds and checks
# target/debug/libnccl_net_wasm.so itself): no NEEDED libibverbs/librdmacm/libmlx5, no undefined
# ibv_*/rdma_*/mlx5dv_* dynamic symbols.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The build `cargo test --workspace` did (same features: a `-p` build would rebuild the
# dependencies a second time); it also puts the shared libraries under target/debug/.
cargo build -q --workspace --all-targets
targets=(target/debug/examples/libib_probe.so target/debug/libnccl_net_wasm.so)
for t in soft ib_soft; do
    bin=$(ls -t target/debug/deps/"$t"-* 2>/dev/null | grep -v '\.d$' | head -n1 || true)
    [ -n "$bin" ] && targets+=("$bin")
done
targets+=("$@")

fail=0
for f in "${targets[@]}"; do
    if [ ! -f "$f" ]; then
        echo "FAIL: $f does not exist"
        fail=1
        continue
    fi
    needed=$(readelf -d "$f" | grep NEEDED | grep -oE '\[[^]]*\]' | tr -d '[]' | tr '\n' ' ')
    bad_needed=$(readelf -d "$f" | grep NEEDED | grep -E 'libibverbs|librdmacm|libmlx5' || true)
    bad_undef=$(nm -D --undefined-only "$f" | grep -E ' (ibv_|rdma_|mlx5dv_)' || true)
    if [ -n "$bad_needed" ] || [ -n "$bad_undef" ]; then
        echo "FAIL: $f"
        [ -n "$bad_needed" ] && echo "  link-time dependency: $bad_needed"
        [ -n "$bad_undef" ] && echo "  undefined verbs symbols:" && echo "$bad_undef" | sed 's/^/    /'
        fail=1
    else
        echo "ok: $f — NEEDED: $needed; no undefined ibv_*/rdma_*/mlx5dv_* symbols"
    fi
done
exit $fail
