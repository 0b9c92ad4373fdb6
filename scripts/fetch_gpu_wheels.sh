#!/usr/bin/env bash
# The wheels the GPU kit carries to a machine that has torch + CUDA (+ transformers) and no network:
# megatron-core and mbridge (the Megatron backend), DeepSpeed's Python (no ops compiled: the kit's ZeRO-2 section
# uses torch's AdamW) and the small packages DeepSpeed imports. ~20 MB in .whl/ (git-ignored):
#   .whl/common/  pure-Python wheels;  .whl/cp311|cp312|cp313/  the compiled ones, per Python version.
# scripts/gpu_check.sh installs .whl/common and the directory of the Python it runs with. Run from the repository
# root with this repo's venv (its pip versions are the ones pinned here).
set -euo pipefail
PY="$(realpath -s "${PYTHON:-.venv/bin/python}")"  # -s: keep the venv link
mkdir -p "${1:-.whl}/common"
DEST="$(realpath "${1:-.whl}")"
get() { "$PY" -m pip download -q --no-deps --only-binary=:all: "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
get -d "$DEST/common" mbridge==0.15.1 hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 nvidia-ml-py==13.615.71 \
    annotated-types==0.8.0 typing-inspection==0.4.5 pydantic==2.14.4
for v in 3.11 3.12 3.13; do
    d="$DEST/cp${v/./}"
    mkdir -p "$d"
    get -d "$d" --python-version "$v" --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        megatron-core==0.16.1 pydantic-core==2.50.5 msgpack==1.2.4 psutil==7.2.2 ninja==1.13.2
done
# DeepSpeed publishes a source distribution only: build its pure-Python wheel (no ops: DS_BUILD_OPS=0).
build="$(mktemp -d)"
(cd "$build" && DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$DEST/common" 2>&1 \
    | grep -v "^WARNING: Location" || true)
rm -rf "$build"
ls -R "$DEST" | grep -c "\.whl$" | xargs -I{} echo "fetch_gpu_wheels: {} wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
