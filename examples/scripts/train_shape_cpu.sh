#!/usr/bin/env bash
# The embedded default on any CPU machine (what the README's first command runs).
# ESTIMATOR=shape|mrt|grpo; extra dotted flags override configs/cpu-smoke.yaml.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bash "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/openrlhf-shape" train --config "$root/configs/cpu-smoke.yaml" \
  --algo.advantage.estimator "${ESTIMATOR:-shape}" "$@"
