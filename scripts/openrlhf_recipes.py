"""OpenRLHF's own RL launch scripts, run here as a user would (issue 35): 2 steps each on the CPU demo model.

Each script's flag list (tests/config/openrlhf_recipes/<name>.txt: OpenRLHF v0.11's examples/scripts, paths
changed to ours) runs with its layout shrunk to this machine (later flags win: 1 rank, 1 engine, a small batch
of short responses), once with the script's own estimator (ppo's: OpenRLHF's default gae, with its reward model and
critic shrunk to a rank each) and once with ``--algo.advantage.estimator shape``.
Flags our check still refuses are listed; with ``--drop_refused`` they are left out and the run goes on.
The agent script gets ``--train.agent_func_path`` = OpenRLHF's example agent when ``OPENRLHF_AGENT_EXAMPLE``
names a copy, else our calculator agent (the same interface; nothing is fetched).

    python scripts/openrlhf_recipes.py --out runs/openrlhf_recipes [--recipes dapo,...] [--estimators own,shape]

``--reward parity`` (default) swaps the scripts' reward file for an even-length reward so every group has signal
on a 135M model in 64 tokens (DAPO's dynamic filtering drops all-wrong groups: with the maths reward the demo
model's 2 x 4 samples are usually all wrong and nothing trains).

Writes ``OUT/summary.json`` and ``OUT/summary.md``: per run the refused flags, exit code, wall seconds, and per
step the reward, KL (``kl``, ``kl_coef``), loss and response length from the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "config"))
from test_openrlhf_recipes import recipe, refused, without  # noqa: E402  (the recipe lists and their parsing)

CRITIC_FREE = ("dapo", "prorlv2_math", "reinforce_baseline", "reinforce_baseline_agent_async")
# Scripts that leave the estimator to OpenRLHF's default (gae: a critic; ours is shape): "own" passes it, and their
# reward model and critic shrink to one rank with four rank processes sharing the colocated bundle's CPUs.
OPENRLHF_DEFAULT_ESTIMATOR = {"ppo": ["--algo.advantage.estimator", "gae", "--reward.num_nodes", "1",
                                      "--reward.num_gpus_per_node", "1", "--critic.num_nodes", "1",
                                      "--critic.num_gpus_per_node", "1", "--actor.num_cpus_per_rank", "0.25"]}
SHRINK = ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_nodes", "1",
          "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
          "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
          "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4",
          "--rollout.max_new_tokens", "64", "--data.max_len", "512", "--vllm.kv_cache_gib", "1",
          "--train.stop_after_steps", "2", "--reward.num_workers", "1", "--eval.n_samples_per_prompt", "1",
          "--eval.max_samples", "4", "--ckpt.save_hf", "false",
          "--ds.param_dtype", "auto"]  # the scripts' bf16: emulated by this CPU, ~4x slower; auto is bf16 on a GPU
RING = ["--ds.ring_attn_size", "1"]  # one rank here: the scripts' ring of 2 shrinks with the layout
# a reward with signal in every group on a 135M model in 64 tokens: even response length (in characters)
PARITY_REWARD = """import torch
def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {}}
"""
REPORT_KEYS = ("rollout/reward/mean", "rollout/accuracy", "kl", "kl_coef", "actor/loss", "actor/updates",
               "actor/samples", "actor/dropped_samples", "rollout/filtered_groups", "rollout/refill_rounds",
               "rollout/prompts_consumed", "rollout/response_length/mean", "time/step")


def prompt_file(out_root: str, split: str) -> str:
    """The bundled maths set under every key the scripts read: ``prompt`` / ``label`` and ``context_messages``
    (a chat: the DAPO script's input), beside our ``question`` / ``answer``."""
    from openrlhf_shape.data.prompts import bundled_math_path

    path = os.path.join(out_root, f"prompts_{split}.jsonl")
    with open(bundled_math_path(split)) as src, open(path, "w") as dst:
        for line in src:
            row = json.loads(line)
            row.update(prompt=row["question"], label=row["answer"],
                       context_messages=[{"role": "user", "content": row["question"]}])
            dst.write(json.dumps(row) + "\n")
    return path


def _argv(name: str, out: str, estimator: str, drop: set[str], reward: str) -> list[str]:
    agent = os.environ.get("OPENRLHF_AGENT_EXAMPLE") or os.path.join(ROOT, "tests", "rollout", "agent_files",
                                                                     "calculator_agent.py")
    root = os.path.dirname(out)
    sub = {"bundled:train": os.path.join(root, "prompts_train.jsonl"), "bundled:test": os.path.join(root, "prompts_test.jsonl"),
           f"runs/openrlhf_recipes/{name}": out,
           "tests/rewards/openrlhf_style/math_reward.py": os.path.join(root, "parity_reward.py") if reward == "parity"
           else os.path.join(ROOT, "tests", "rewards", "openrlhf_style", "math_reward.py"), f"runs/openrlhf_recipes/{name}/ckpt": out + "/ckpt",
           f"runs/openrlhf_recipes/{name}/runs": out + "/tb", "examples/python/agent_func.py": agent}
    argv = [sub.get(a, a) for a in recipe(name)] + SHRINK
    if "--ds.ring_attn_size" in argv:
        argv += RING
    if estimator != "own":
        argv += ["--algo.advantage.estimator", estimator]
    elif name in OPENRLHF_DEFAULT_ESTIMATOR:
        argv += OPENRLHF_DEFAULT_ESTIMATOR[name]
    return without(argv, drop)


def run_one(name: str, estimator: str, out_root: str, drop_refused: bool, reward: str) -> dict:
    out = os.path.join(out_root, f"{name}-{estimator}")
    lines = refused(recipe(name))
    argv = _argv(name, out, estimator, set(lines) if drop_refused else set(), reward)
    cmd = [sys.executable, "-m", "openrlhf_shape.cli.main", "train", *argv]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True)
    rec = {"recipe": name, "estimator": estimator, "refused": lines, "dropped": sorted(lines) if drop_refused else [],
           "returncode": proc.returncode, "wall_s": round(time.time() - t0, 1), "command": " ".join(cmd[3:])}
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        rows = [json.loads(ln) for ln in open(metrics)]
        rec["steps"] = [{k: r.get(k) for k in ("step",) + REPORT_KEYS if k in r} for r in rows]
    if proc.returncode:
        rec["error_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return rec


def _markdown(runs: list[dict]) -> str:
    head = ("| recipe | estimator | refused | rc | wall s | steps | per step: reward / kl / applied kl_coef / "
            "samples trained (dropped) / refill rounds / prompts consumed |\n|---|---|---|---|---|---|---|\n")
    rows = []
    for r in runs:
        per = "; ".join(f"{s.get('rollout/reward/mean', float('nan')):.3f} / {s.get('kl', float('nan')):.2e} / "
                        f"{s.get('kl_coef', float('nan')):.1e} / {s.get('actor/samples', '-')} "
                        f"({s.get('actor/dropped_samples', '-')}) / {s.get('rollout/refill_rounds', '-')} / "
                        f"{s.get('rollout/prompts_consumed', '-')}" for s in r.get("steps", []))
        rows.append(f"| {r['recipe']} | {r['estimator']} | {len(r['refused'])} | {r['returncode']} | {r['wall_s']} | "
                    f"{len(r.get('steps', []))} | {per} |")
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/openrlhf_recipes")
    ap.add_argument("--recipes", default=",".join(CRITIC_FREE + tuple(OPENRLHF_DEFAULT_ESTIMATOR)))
    ap.add_argument("--estimators", default="own,shape", help="own = the script's; any estimator name")
    ap.add_argument("--reward", choices=("parity", "math"), default="parity",
                    help="parity: the scripts' reward file replaced by an even-length reward (signal in every group "
                         "on the demo model); math: tests/rewards/openrlhf_style/math_reward.py (OpenRLHF's style)")
    ap.add_argument("--drop_refused", action="store_true", help="leave out the flags our check refuses")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "test"):
        prompt_file(os.path.abspath(args.out), split)
    with open(os.path.join(os.path.abspath(args.out), "parity_reward.py"), "w") as f:
        f.write(PARITY_REWARD)
    runs = []
    for name in args.recipes.split(","):
        for est in args.estimators.split(","):
            rec = run_one(name, est, os.path.abspath(args.out), args.drop_refused, args.reward)
            runs.append(rec)
            print(f"[recipes] {name} / {est}: rc {rec['returncode']}, {rec['wall_s']} s, "
                  f"{len(rec.get('steps', []))} steps, refused {sorted(rec['refused'])}", flush=True)
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(runs, f, indent=1)
            with open(os.path.join(args.out, "summary.md"), "w") as f:
                f.write(_markdown(runs))


if __name__ == "__main__":
    main()
