#!/usr/bin/env bash
# The CPU learning curve (docs/results/learning_curve.md): train the demo policy with configs/cpu-learn.yaml,
# held-out avg@8 pass@1 with 95% CIs at step 0, the middle and the end; then draw the analyze figures.
#
#   bash scripts/learning_curve.sh                 # GRPO then SHAPE, one after the other (what docs/results used)
#   bash scripts/learning_curve.sh grpo            # one estimator
#   PARALLEL=1 bash scripts/learning_curve.sh grpo shape   # both at once (needs ~20 GiB free)
#   bash scripts/learning_curve.sh shape --train.num_steps 2   # extra flags go to every run
#
# Each run writes runs/learn-<estimator>/ (metrics.jsonl, report.md, log.txt, checkpoints/, hf/); running
# again resumes from the final checkpoint (nothing to redo). Afterwards:
#   python scripts/summarize_learning_curve.py runs/learn-grpo runs/learn-shape --out docs/results
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# Ray's memory monitor kills actors when the *node* passes ~92% memory, whoever uses it: on a machine shared
# with other jobs it killed a run's vLLM engine. Off by default here; the kernel still stops a real OOM.
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
# Ray starts its workers (the vLLM engine, the Megatron rank) at niceness 15; on a shared machine they then
# starve behind every other job. The runs keep the shell's priority instead.
export RAY_worker_niceness=${RAY_worker_niceness:-0}
RUNS=${RUNS:-runs}
ests=()
while [[ $# -gt 0 && $1 != --* ]]; do ests+=("$1"); shift; done
[[ ${#ests[@]} -gt 0 ]] || ests=(grpo shape)
for e in "${ests[@]}"; do
  case $e in grpo|shape|mrt) ;; *) echo "unknown estimator '$e' (grpo, shape or mrt)" >&2; exit 2 ;; esac
done

train() {  # $1 = estimator, rest = extra flags
  local est=$1; shift
  local out="$RUNS/learn-$est"
  mkdir -p "$out"
  echo "[$(date -u +%H:%M:%S)] $est -> $out (log: $out/log.txt)"
  "$PY" -m openrlhf_shape.cli.main train --config configs/cpu-learn.yaml \
    --algo.advantage.estimator "$est" --ckpt.output_dir "$out" "$@" >>"$out/log.txt" 2>&1
  echo "[$(date -u +%H:%M:%S)] $est done"
}

if [[ ${PARALLEL:-0} == 1 ]]; then
  pids=()
  for e in "${ests[@]}"; do train "$e" "$@" & pids+=($!); done
  rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || { echo "a run failed: see $RUNS/learn-*/log.txt" >&2; exit 1; }
else
  for e in "${ests[@]}"; do train "$e" "$@"; done
fi

dirs=(); for e in "${ests[@]}"; do dirs+=("$RUNS/learn-$e"); done
"$PY" -m openrlhf_shape.cli.main analyze "${dirs[@]}" --labels "${ests[@]^^}" --out_dir "$RUNS/learn-analysis"
