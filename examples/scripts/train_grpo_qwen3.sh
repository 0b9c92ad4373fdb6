#!/usr/bin/env bash
# GRPO baseline with the same preset as train_shape_qwen3.sh (MODEL=Qwen3-4B|8B|14B|32B|30B-A3B|235B-A22B).
ESTIMATOR=grpo exec bash "$(dirname "$0")/train_shape_qwen3.sh" "$@"
