#!/usr/bin/env bash
# SHAPE on Qwen3 (4B/8B/14B/32B) on H100 80 GB nodes, inside our Docker image.
#
#   MODEL=Qwen3-8B MODEL_PATH=/models/Qwen3-8B DATA=/data/train.parquet \
#     bash examples/scripts/train_shape_qwen3.sh [--dotted.flag value ...]
#
# Start Ray first: `ray start --head` on node 0 and `ray start --address=<head>:6379` on the others
# (docker/ray-head.sh and docker/ray-worker.sh do that inside the image); run this on the head node.
# Presets (TP/PP/DP and vLLM engines sized for 80 GB GPUs) are configs/qwen3-*.yaml; the sizing
# rationale is docs/cluster_sizing.md. Extra dotted flags override the preset.
set -euo pipefail
MODEL="${MODEL:-Qwen3-4B}"
case "$MODEL" in
  Qwen3-4B) preset=qwen3-4b ;;
  Qwen3-8B) preset=qwen3-8b ;;
  Qwen3-14B) preset=qwen3-14b ;;
  Qwen3-32B) preset=qwen3-32b ;;
  *) echo "MODEL must be one of Qwen3-4B, Qwen3-8B, Qwen3-14B, Qwen3-32B (got '$MODEL')" >&2; exit 2 ;;
esac
ESTIMATOR="${ESTIMATOR:-shape}"   # shape | mrt | grpo
root="$(cd "$(dirname "$0")/../.." && pwd)"
args=(--config "$root/configs/$preset.yaml" --algo.advantage.estimator "$ESTIMATOR")
[ -n "${MODEL_PATH:-}" ] && args+=(--actor.model_name_or_path "$MODEL_PATH")
[ -n "${DATA:-}" ] && args+=(--data.prompt_dataset "$DATA")
[ -n "${OUTPUT_DIR:-}" ] && args+=(--ckpt.output_dir "$OUTPUT_DIR")
exec openrlhf-shape train "${args[@]}" "$@"
