#!/usr/bin/env bash
# SHAPE on Qwen3 on H100 80 GB nodes, inside our Docker image: dense (4B/8B/14B/32B) and mixture of experts
# (30B-A3B, 235B-A22B).
#
#   MODEL=Qwen3-8B MODEL_PATH=/models/Qwen3-8B DATA=/data/train.parquet \
#     bash examples/scripts/train_shape_qwen3.sh [--dotted.flag value ...]
#
# Start Ray first: `ray start --head` on node 0 and `ray start --address=<head>:6379` on the others
# (the image's entrypoint does that: `docker run ... openrlhf-shape ray-head` / `ray-worker HEAD_IP`); run this on
# the head node. MODEL picks the preset configs/<model in lower case>.yaml (TP/PP/DP, experts and vLLM engines sized
# for 80 GB GPUs; the sizing rationale is docs/cluster_sizing.md). Extra dotted flags override the preset;
# `--dry_run` prints the plan and starts nothing.
set -euo pipefail
MODEL="${MODEL:-Qwen3-4B}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
preset="$(printf '%s' "$MODEL" | tr '[:upper:]' '[:lower:]')"
if [[ ! "$preset" =~ ^qwen3-[0-9a-z.-]+$ ]] || [ ! -f "$root/configs/$preset.yaml" ]; then
  choices="$(cd "$root/configs" && for f in qwen3-*.yaml; do rest="${f%.yaml}"; rest="${rest#qwen3-}"; printf 'Qwen3-%s ' "${rest^^}"; done)"
  echo "MODEL must be one of: ${choices% } (got '$MODEL'; each is a preset configs/<model in lower case>.yaml)" >&2
  exit 2
fi
ESTIMATOR="${ESTIMATOR:-shape}"   # shape | mrt | grpo
args=(--config "$root/configs/$preset.yaml" --algo.advantage.estimator "$ESTIMATOR")
[ -n "${MODEL_PATH:-}" ] && args+=(--actor.model_name_or_path "$MODEL_PATH")
[ -n "${DATA:-}" ] && args+=(--data.prompt_dataset "$DATA")
[ -n "${OUTPUT_DIR:-}" ] && args+=(--ckpt.output_dir "$OUTPUT_DIR")
exec openrlhf-shape train "${args[@]}" "$@"
