#!/bin/sh
# The GPU kit's entry point: NCCL collectives through the nccl-net-wasm plugin on one GPU.
# Arguments go to run.py (--dry-run, --quick, --sizes, --configs, --out); see README.md.
exec "${PYTHON:-python3}" "$(dirname "$0")/run.py" "$@"
