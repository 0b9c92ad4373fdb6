"""Adaptive probe budget vs fixed m on the CPU demo (SmolLM2-135M, bundled maths set).

    .venv/bin/python benchmarks/bench_adaptive_probes.py [--prompts 8] [--samples 4] [--gt-m 64]

One rollout of the demo preset (entropy boundaries, K = 4) fixes a set of responses. Ground-truth
potentials come from ``--gt-m`` probe samples per state. Each probe setting then runs ``--repeats``
times from the same cache state (prompt + response prefilled, as right after the rollout) and is
compared with the ground truth: probe decode tokens, prefill tokens computed, wall time, MSE of
Phi over the probed states, and MSE / sign agreement of the final token advantages (SHAPE + TCR of
the preset). ``exp_*`` columns are exact expectations under the binomial model with the
ground-truth Phi as the truth (no sampling noise; see openrlhf_shape/algorithms/adaptive_probes.py).
The ground truth is itself an estimate: its variance Phi(1-Phi)/gt_m adds to every measured MSE.

Settings: ``fixed:M`` or ``adaptive:FIRST,ROUND,CAP,TOL``. The last line compares ``--default``
with ``fixed:8``: ``adaptive: probe_tokens_ratio=R advantage_mse_ratio=Q``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

DEFAULT_SETTINGS = [
    "fixed:4", "fixed:8",
    "adaptive:4,4,8,0.13", "adaptive:4,4,8,0.19", "adaptive:2,2,8,0.19",
    "adaptive:4,4,12,0.13", "adaptive:4,4,16,0.11", "adaptive:2,2,4,0.19",
]


def probe_config(spec: str, max_tokens: int):
    from openrlhf_shape.rollout import ProbeConfig

    kind, _, rest = spec.partition(":")
    if kind == "fixed":
        return ProbeConfig(num_probes=int(rest), max_tokens=max_tokens)
    if kind == "adaptive":
        first, rnd, cap, tol = rest.split(",")
        return ProbeConfig(num_probes=int(cap), max_tokens=max_tokens, adaptive=True, adaptive_tol=float(tol),
                           max_probes=int(cap), adaptive_first_round=int(first), adaptive_round_size=int(rnd))
    raise ValueError(f"setting {spec!r}: use fixed:M or adaptive:FIRST,ROUND,CAP,TOL")


def unique_states(st, potentials: list[torch.Tensor]) -> torch.Tensor:
    """Phi of every probed state once (s_0 once per prompt, then interior boundaries), float64 [S]."""
    out, seen = [], set()
    for p, phi in zip(st.prompts, potentials):
        key = tuple(p)
        if key not in seen:
            out.append(phi[0])
            seen.add(key)
        out.extend(phi[1:-1])
    return torch.stack(out).double()


def advantages(st, potentials: list[torch.Tensor]) -> torch.Tensor:
    from openrlhf_shape.algorithms import compute_token_advantages, pad_potentials

    res = compute_token_advantages(st.shape, st.mask, st.rewards, st.n_samples, st.max_new_tokens,
                                   entropy=st.entropy, boundaries=st.boundaries,
                                   potentials=pad_potentials(potentials, st.shape.num_segments))
    return res.token_advantages[st.mask].double()


def run_probes(st, cfg, reward, seed: int):
    from demo_states import warm_rollout_cache

    from openrlhf_shape.rollout import ProbeSuffixes, estimate_potentials

    warm_rollout_cache(st)
    st.group.reseed(seed)
    t0 = time.perf_counter()
    res = estimate_potentials(st.group, st.prompts, st.responses, st.boundary_lists, st.labels,
                              [float(x) for x in st.rewards], reward, cfg, ProbeSuffixes.from_tokenizer(st.tokenizer, cfg))
    return res, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--gt-m", type=int, default=64, help="probe samples per state for the ground truth")
    ap.add_argument("--gt-chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS)
    ap.add_argument("--default", default="adaptive:4,4,8,0.13", help="the setting of the last line")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-gt", default=None, help="write the ground-truth Phi of every state (JSON) here")
    args = ap.parse_args()
    if args.gt_m % args.gt_chunk:
        ap.error("--gt-m must be a multiple of --gt-chunk")
    settings = list(dict.fromkeys([*args.settings, "fixed:8", args.default]))

    from demo_states import build_demo_states

    from openrlhf_shape.algorithms.adaptive_probes import estimator_moments
    from openrlhf_shape.rewards.computer import RewardComputer

    reward = RewardComputer()
    t0 = time.perf_counter()
    st = build_demo_states(args.prompts, args.samples, seed=args.seed, reward=reward)
    T = int(st.mask.sum())
    print(f"demo rollout: {len(st.responses)} responses ({args.prompts} prompts x {args.samples}), {T} tokens, "
          f"accuracy {float(st.rewards.mean()):.3f}, {sum(len(b) for b in st.boundary_lists)} interior boundaries "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    # ground truth: gt_m samples per state, in chunks (each chunk reseeded differently)
    t0 = time.perf_counter()
    chunks = []
    for c in range(args.gt_m // args.gt_chunk):
        res, _ = run_probes(st, probe_config(f"fixed:{args.gt_chunk}", st.shape.probe_max_tokens), reward, 10_000 + c)
        chunks.append(res.potentials)
    gt = [torch.stack([ch[i] for ch in chunks]).mean(0) for i in range(len(st.responses))]
    gt_states = unique_states(st, gt)
    gt_adv = advantages(st, gt)
    gt_var = float((gt_states * (1 - gt_states)).mean() / args.gt_m)
    if args.save_gt:
        import json

        with open(args.save_gt, "w") as f:
            json.dump({"gt_m": args.gt_m, "phi": gt_states.tolist()}, f)
    hist = torch.histc(gt_states.float(), bins=5, min=0, max=1).int().tolist()
    print(f"ground truth: m={args.gt_m} on {gt_states.numel()} states in {time.perf_counter() - t0:.0f} s; "
          f"Phi histogram over [0,1] in 5 bins {hist}; share of states with Phi in {{0, 1}} "
          f"{float(((gt_states == 0) | (gt_states == 1)).double().mean()):.2f}; its own noise adds ~{gt_var:.4f} to "
          f"each Phi MSE", flush=True)

    rows = {}
    for spec in settings:
        cfg = probe_config(spec, st.shape.probe_max_tokens)
        acc = {k: 0.0 for k in ("decode", "prefill", "wall", "rounds", "samples", "phi_mse", "adv_mse", "sign")}
        for rep in range(args.repeats):
            res, wall = run_probes(st, cfg, reward, 1 + rep)
            s = res.stats
            est_states = unique_states(st, res.potentials)
            adv = advantages(st, res.potentials)
            acc["decode"] += s["probe_decode_tokens"]
            acc["prefill"] += s["probe_computed_prompt_tokens"]
            acc["wall"] += wall
            acc["rounds"] += s["probe_rounds"]
            acc["samples"] += s["probe_samples_per_state"]
            acc["phi_mse"] += float(((est_states - gt_states) ** 2).mean())
            acc["adv_mse"] += float(((adv - gt_adv) ** 2).mean())
            acc["sign"] += float((torch.sign(adv) == torch.sign(gt_adv)).double().mean())
        row = {k: v / args.repeats for k, v in acc.items()}
        rule = cfg.rule()
        if rule is None:
            from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule

            rule = AdaptiveProbeRule(cfg.num_probes, 1, cfg.num_probes, 0.0)
        mom = [estimator_moments(rule, float(p)) for p in gt_states.clamp(0, 1)]
        row["exp_samples"] = sum(m["expected_samples"] for m in mom) / len(mom)
        row["exp_phi_mse"] = sum(m["mse"] for m in mom) / len(mom)
        rows[spec] = row
        print(f"{spec:<22} decode {row['decode']:8.0f}  prefill {row['prefill']:8.0f}  wall {row['wall']:6.1f} s  "
              f"rounds {row['rounds']:.1f}  samples/state {row['samples']:5.2f} (exp {row['exp_samples']:5.2f})  "
              f"phi_mse {row['phi_mse']:.4f} (exp {row['exp_phi_mse']:.4f})  adv_mse {row['adv_mse']:.5f}  "
              f"sign {row['sign']:.3f}", flush=True)
    reward.close()
    st.group.shutdown()
    d, f8 = rows[args.default], rows["fixed:8"]
    print(f"default {args.default} vs fixed:8 (mean of {args.repeats} repeats; machine shared, wall times noisy): "
          f"prefill ratio {d['prefill'] / f8['prefill']:.2f}, wall ratio {d['wall'] / f8['wall']:.2f}, "
          f"expected Phi MSE ratio {d['exp_phi_mse'] / f8['exp_phi_mse']:.2f}")
    print(f"adaptive: probe_tokens_ratio={d['decode'] / f8['decode']:.2f} advantage_mse_ratio={d['adv_mse'] / f8['adv_mse']:.2f}")


if __name__ == "__main__":
    main()
