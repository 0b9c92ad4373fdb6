#!/usr/bin/env bash
# Container entry point:
#   ray-head                 start the Ray head on this node and keep the container alive
#   ray-worker HEAD_IP       join the Ray cluster at HEAD_IP:6379 and stay alive
#   train|eval|convert|analyze ...   run the CLI (on the head node once all workers joined)
#   anything else            exec it as a command (e.g. bash examples/scripts/train_shape_qwen3.sh)
set -euo pipefail
export TOKENIZERS_PARALLELISM=false  # set here, not in the image's ENV (hadolint DL3064 flags *TOKEN* names)
case "${1:-}" in
  ray-head)
    ray start --head --port=6379 --dashboard-host=0.0.0.0 --num-gpus="$(nvidia-smi -L | wc -l)"
    exec sleep infinity ;;
  ray-worker)
    [ -n "${2:-}" ] || { echo "usage: ray-worker HEAD_IP" >&2; exit 2; }
    ray start --address="$2:6379" --num-gpus="$(nvidia-smi -L | wc -l)"
    exec sleep infinity ;;
  train|eval|convert|analyze|--help|-h)
    exec openrlhf-shape "$@" ;;
  *)
    exec "$@" ;;
esac
