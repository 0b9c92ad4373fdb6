#!/usr/bin/env bash
# The paper's 1.5B runs: MODEL=DeepSeek-R1-Distill-Qwen-1.5B (default) or DeepScaleR-1.5B-Preview,
# K = 8 segments and 8192 response tokens, one 8-GPU node. ESTIMATOR=shape|mrt|grpo.
# BACKEND=megatron (default: the preset's, verified on an H100) or deepspeed (ZeRO-2, OpenRLHF's own backend;
# add e.g. --ds.zero_stage 3 or --ds.adam_offload after the script's name).
set -euo pipefail
MODEL="${MODEL:-DeepSeek-R1-Distill-Qwen-1.5B}"
case "$MODEL" in
  DeepSeek-R1-Distill-Qwen-1.5B) preset=deepseek-r1-distill-qwen-1.5b ;;
  DeepScaleR-1.5B-Preview) preset=deepscaler-1.5b ;;
  *) echo "MODEL must be DeepSeek-R1-Distill-Qwen-1.5B or DeepScaleR-1.5B-Preview (got '$MODEL')" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "$0")/../.." && pwd)"
args=(--config "$root/configs/$preset.yaml" --algo.advantage.estimator "${ESTIMATOR:-shape}")
[ -n "${MODEL_PATH:-}" ] && args+=(--actor.model_name_or_path "$MODEL_PATH")
[ -n "${DATA:-}" ] && args+=(--data.prompt_dataset "$DATA")
[ -n "${BACKEND:-}" ] && args+=(--actor.backend "$BACKEND")
exec openrlhf-shape train "${args[@]}" "$@"
