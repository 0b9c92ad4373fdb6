#!/usr/bin/env bash
# MRT baseline (A_k = R + alpha (R - Phi_k), same segments and probes) with the SHAPE preset.
ESTIMATOR=mrt exec bash "$(dirname "$0")/train_shape_qwen3.sh" "$@"
