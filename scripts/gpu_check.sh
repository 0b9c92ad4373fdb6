#!/usr/bin/env bash
# GPU verification kit: one command on a single-GPU machine, from the repository root.
#
#   bash scripts/gpu_check.sh OUTDIR            # GPU: parity, train + resume + export, throughput
#   bash scripts/gpu_check.sh OUTDIR --smoke    # CPU: same code, tiny model (tests/gpu_kit/)
#   extra flags go to benchmarks/gpu/gpu_kit.py (--sections, --cases, --timeout, --workdir; --jobs N and
#   --preload_ranks with --smoke)
#
# Packages: if megatron.core / mbridge are not importable, the wheels carried in .whl/ (made by
# scripts/fetch_gpu_wheels.sh: megatron-core, mbridge, DeepSpeed's Python and its small dependencies) are installed with --no-index --no-deps
# into a scratch directory ($SHAPE_KIT_SITE, default /tmp/shape_kit_site) that goes on PYTHONPATH.
# The repository root goes on PYTHONPATH only when openrlhf_shape is not installed.
# Python: $PYTHON, else python3. Results: OUTDIR/gpu_kit.json, OUTDIR/gpu_kit.md.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_check.sh OUTDIR [--smoke] [gpu_kit.py flags]" >&2
    exit 2
fi
OUT_DIR="$1"
shift
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SITE="${SHAPE_KIT_SITE:-/tmp/shape_kit_site}"
WHEELS="${SHAPE_KIT_WHEELS:-$REPO_ROOT/.whl}"
export PYTHONUNBUFFERED=1

installed=0
if ! (cd / && "$PY" -c "import megatron.core, mbridge") >/dev/null 2>&1; then
    shopt -s nullglob
    # .whl/*.whl, .whl/common/*.whl (pure Python) and .whl/cpXY/*.whl for this Python (scripts/fetch_gpu_wheels.sh)
    pyver="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    wheels=("$WHEELS"/*.whl "$WHEELS"/common/*.whl "$WHEELS/$pyver"/*.whl)
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "gpu_check: megatron.core/mbridge not importable and no wheels in $WHEELS;" \
             "run: bash scripts/fetch_gpu_wheels.sh (docs/gpu_results.md)" >&2
        exit 3
    fi
    echo "gpu_check: installing ${#wheels[@]} carried wheel(s) into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    installed=1
fi
if ! (cd / && "$PY" -c "import openrlhf_shape") >/dev/null 2>&1; then
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
# Show the import errors (if any) of the wheels just installed before the sections start. Without an install,
# megatron.core and mbridge imported above, and a section records any other import error; this second
# Megatron import costs ~5 s of CPU.
if [[ $installed -eq 1 ]]; then
    "$PY" -c "import megatron.core, mbridge, openrlhf_shape.megatron.worker" 2>&1 | grep -v -i "warn" || true
fi

exec "$PY" "$REPO_ROOT/benchmarks/gpu/gpu_kit.py" "$OUT_DIR" "$@"
