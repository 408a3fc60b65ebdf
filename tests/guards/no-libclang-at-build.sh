#!/usr/bin/env bash
# Guard: nothing in the build loads libclang (no bindgen, no clang-sys in Cargo.lock), so the
# workspace builds whatever libclang a machine has. rdma-sys's bindgen 0.59 panicked with
# Debian 13's libclang 19, which comes with the clang-19 C policies are built with; the verbs
# declarations are hand-written now (host/ibverbs-sys). CI installs libclang1-19 before the
# workspace builds, and this guard keeps a build-time libclang user from coming back unseen.
set -euo pipefail
cd "$(dirname "$0")/../.."
found=$(grep -E '^name = "(bindgen|clang-sys)"$' Cargo.lock || true)
if [ -n "$found" ]; then
  echo "FAIL: Cargo.lock holds a crate that loads libclang at build time:"
  echo "$found"
  exit 1
fi
echo "OK: no crate loads libclang at build time (bindgen, clang-sys)"
