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

The token advantages are affine in the potentials, so each setting also gets its *exact* expected
advantage MSE (``exp``: bias and variance of every state at its ground-truth Phi, pushed through the
Jacobian). ``--search`` prints the exact frontier of a grid of rules (samples ratio vs advantage-MSE
ratio against fixed m = 8); ``--save-gt FILE`` keeps the ground truth and Jacobian so that
``--search-from FILE`` re-derives the frontier without engines.

Settings: ``fixed:M`` or ``adaptive:FIRST,ROUND,CAP,TOL``. The last line compares ``--default`` (the
``--probe.adaptive`` default, 4,5,9,0.13) with ``fixed:8``:
``adaptive: probe_tokens_ratio=R advantage_mse_ratio=Q`` (measured, mean of ``--repeats``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

DEFAULT_SETTINGS = [
    "fixed:4", "fixed:8", "adaptive:4,5,9,0.13", "adaptive:4,4,8,0.13", "adaptive:2,2,4,0.19",
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


def state_index(st) -> list[list[int]]:
    """Per response: the index in the unique-state vector (see :func:`unique_states`) of each of its
    probed states, s_0 first."""
    out, first, nxt = [], {}, 0
    for p, bs in zip(st.prompts, st.boundary_lists):
        key = tuple(p)
        if key not in first:
            first[key] = nxt
            nxt += 1
        out.append([first[key], *range(nxt, nxt + len(bs))])
        nxt += len(bs)
    return out


def potentials_of(st, states: torch.Tensor, index: list[list[int]]) -> list[torch.Tensor]:
    """Per-response potentials [K_i + 1] from a unique-state vector [S] (the last one is R_i)."""
    return [torch.cat([states[idx].float(), st.rewards[i : i + 1].float()]) for i, idx in enumerate(index)]


def advantage_jacobian(st, gt_states: torch.Tensor, index: list[list[int]]) -> torch.Tensor:
    """d(token advantages) / d(Phi of each state), float64 [S, N] (N valid tokens). The advantage is
    affine in the potentials (eq. 8-9, then TCR weights that depend on entropy only), so unit
    differences give the exact Jacobian; checked on a random combination."""
    base = advantages(st, potentials_of(st, gt_states, index))
    rows = []
    for s in range(gt_states.numel()):  # potentials must stay in [0, 1]: step by +-1/2
        e = gt_states.clone()
        step = 0.5 if float(e[s]) < 0.5 else -0.5
        e[s] += step
        rows.append((advantages(st, potentials_of(st, e, index)) - base) / step)
    jac = torch.stack(rows)
    other = torch.rand(gt_states.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    direct = advantages(st, potentials_of(st, other, index)) - base
    if not torch.allclose(direct, (other - gt_states) @ jac, atol=1e-4):
        raise RuntimeError("token advantages are not affine in the potentials: the exact expectation does not apply")
    return jac


def expected_advantage_mse(rule, gt_states: torch.Tensor, jac: torch.Tensor) -> tuple[float, float, float]:
    """(expected samples per state, expected Phi MSE, expected token-advantage MSE) of ``rule`` when
    each state's true Phi is its ground-truth value, exactly under the binomial model. States are
    probed independently, so E||J^T e||^2 = ||J^T bias||^2 + sum_s ||J_s||^2 Var(e_s)."""
    from openrlhf_shape.algorithms.adaptive_probes import estimator_moments

    memo: dict[float, dict[str, float]] = {}
    mom = []
    for p in gt_states.clamp(0, 1).tolist():
        if p not in memo:
            memo[p] = estimator_moments(rule, p)
        mom.append(memo[p])
    bias = torch.tensor([m["bias"] for m in mom], dtype=torch.float64)
    var = torch.tensor([m["mse"] - m["bias"] ** 2 for m in mom], dtype=torch.float64).clamp_min(0)
    n_tok = jac.shape[1]
    adv = (float((bias @ jac).pow(2).sum()) + float((jac.pow(2).sum(1) * var).sum())) / n_tok
    return (sum(m["expected_samples"] for m in mom) / len(mom), sum(m["mse"] for m in mom) / len(mom), adv)


def fixed_rule(m: int):
    from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule

    return AdaptiveProbeRule(m, 1, m, 0.0)


def search_rules(gt_states: torch.Tensor, jac: torch.Tensor, ref_m: int = 8, max_cap: int = 16) -> list[tuple]:
    """Every (first, round, cap, tol) rule on a grid, scored exactly against fixed m = ``ref_m``:
    rows (token ratio, advantage-MSE ratio, Phi-MSE ratio, rule) of the Pareto frontier, cheapest
    first. tol is taken at the distinct posterior sds (each gives a distinct stopping set)."""
    from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule, jeffreys_posterior_sd, stopping_outcomes

    ref = expected_advantage_mse(fixed_rule(ref_m), gt_states, jac)
    sds = sorted({round(jeffreys_posterior_sd(s, n), 6) for n in range(1, max_cap + 1) for s in range(n + 1)})
    seen, rows = set(), []
    for cap in range(4, max_cap + 1):
        for first in range(1, min(cap, 8) + 1):
            for rnd in (1, 2, 3, 4):
                for sd in sds:
                    rule = AdaptiveProbeRule(first, rnd, cap, min(sd + 1e-6, 0.4999))
                    sig = tuple((pt.n, pt.successes) for pt in stopping_outcomes(rule))
                    if sig in seen:
                        continue
                    seen.add(sig)
                    n, phi, adv = expected_advantage_mse(rule, gt_states, jac)
                    rows.append((n / ref_m, adv / ref[2], phi / ref[1], rule))
    rows.sort(key=lambda r: (r[0], r[1]))
    frontier, best = [], float("inf")
    for r in rows:
        if r[1] < best - 1e-9:
            frontier.append(r)
            best = r[1]
    return frontier


def print_frontier(gt_states: torch.Tensor, jac: torch.Tensor, max_cap: int) -> None:
    for label, cap_limit in (("caps <= 9 (the paper's gamma_min 0.9 allows them)", 9), (f"caps <= {max_cap}", max_cap)):
        frontier = search_rules(gt_states, jac, max_cap=cap_limit)
        print(f"exact frontier against fixed:8, {label}: E[samples] ratio, advantage-MSE ratio, Phi-MSE ratio "
              f"(cap c needs --shape.gamma_min > (c-1)/c)", flush=True)
        for tok, adv_r, phi_r, rule in frontier:
            if tok <= 0.75:
                print(f"  adaptive:{rule.first_round},{rule.round_size},{rule.max_probes},{rule.tol:.4f}  "
                      f"tokens {tok:.3f}  adv_mse {adv_r:.3f}  phi_mse {phi_r:.3f}  checkpoints {rule.checkpoints()}")


def advantages(st, potentials: list[torch.Tensor]) -> torch.Tensor:
    from openrlhf_shape.algorithms import compute_token_advantages, get_estimator, pad_potentials

    res = compute_token_advantages(get_estimator("shape", st.shape), st.mask, st.rewards, st.n_samples, st.max_new_tokens,
                                   entropy=st.entropy, boundaries=st.boundaries,
                                   potentials=pad_potentials(potentials, st.shape.num_segments))
    return res.token_advantages[st.mask].double()


def run_probes(st, cfg, reward, seed: int):
    from demo_states import warm_rollout_cache

    from openrlhf_shape.rollout import ProbeSuffixes, estimate_potentials

    warm_rollout_cache(st)
    t0 = time.perf_counter()
    res = estimate_potentials(st.group, st.prompts, st.responses, st.boundary_lists, st.labels,
                              [float(x) for x in st.rewards], reward, cfg, ProbeSuffixes.from_tokenizer(st.tokenizer, cfg),
                              seed=seed)
    return res, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--gt-m", type=int, default=64, help="probe samples per state for the ground truth")
    ap.add_argument("--gt-chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS)
    ap.add_argument("--default", default="adaptive:4,5,9,0.13", help="the setting of the last line (the --probe.adaptive default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--search", action="store_true", help="print the exact token/error frontier of a rule grid")
    ap.add_argument("--search-max-cap", type=int, default=12)
    ap.add_argument("--save-gt", default=None, help="write the ground-truth Phi and the advantage Jacobian here (torch)")
    ap.add_argument("--search-from", default=None, help="only print the frontier from a --save-gt file (no engines)")
    args = ap.parse_args()
    if args.gt_m % args.gt_chunk:
        ap.error("--gt-m must be a multiple of --gt-chunk")
    settings = list(dict.fromkeys([*args.settings, "fixed:8", args.default]))
    if args.search_from:
        saved = torch.load(args.search_from)
        print_frontier(saved["phi"], saved["jacobian"], args.search_max_cap)
        return

    from demo_states import build_demo_states

    from openrlhf_shape.rewards.computer import RewardComputer

    reward = RewardComputer()
    t0 = time.perf_counter()
    st = build_demo_states(args.prompts, args.samples, seed=args.seed, reward=reward)
    T = int(st.mask.sum())
    print(f"demo rollout: {len(st.responses)} responses ({args.prompts} prompts x {args.samples}), {T} tokens, "
          f"accuracy {float(st.rewards.mean()):.3f}, {sum(len(b) for b in st.boundary_lists)} interior boundaries "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    # ground truth: gt_m samples per state, in chunks (each chunk with its own seed stream)
    t0 = time.perf_counter()
    chunks = []
    for c in range(args.gt_m // args.gt_chunk):
        res, _ = run_probes(st, probe_config(f"fixed:{args.gt_chunk}", st.probe.max_tokens), reward, 10_000 + c)
        chunks.append(res.potentials)
    gt = [torch.stack([ch[i] for ch in chunks]).mean(0) for i in range(len(st.responses))]
    gt_states = unique_states(st, gt)
    gt_adv = advantages(st, gt)
    gt_var = float((gt_states * (1 - gt_states)).mean() / args.gt_m)
    hist = torch.histc(gt_states.float(), bins=5, min=0, max=1).int().tolist()
    print(f"ground truth: m={args.gt_m} on {gt_states.numel()} states in {time.perf_counter() - t0:.0f} s; "
          f"Phi histogram over [0,1] in 5 bins {hist}; share of states with Phi in {{0, 1}} "
          f"{float(((gt_states == 0) | (gt_states == 1)).double().mean()):.2f}; its own noise adds ~{gt_var:.4f} to "
          f"each Phi MSE", flush=True)

    index = state_index(st)
    jac = advantage_jacobian(st, gt_states, index)
    gt_adv_noise = float((jac.pow(2).sum(1) * gt_states * (1 - gt_states)).sum()) / args.gt_m / jac.shape[1]
    print(f"its noise adds ~{gt_adv_noise:.5f} to each measured advantage MSE", flush=True)
    if args.save_gt:  # the frontier can be re-derived from this file without engines (--search-from)
        torch.save({"gt_m": args.gt_m, "phi": gt_states, "jacobian": jac}, args.save_gt)
    if args.search:
        print_frontier(gt_states, jac, args.search_max_cap)

    rows = {}

    for spec in settings:
        cfg = probe_config(spec, st.probe.max_tokens)
        acc = {k: 0.0 for k in ("decode", "prefill", "wall", "rounds", "samples", "phi_mse", "adv_mse", "sign")}
        for rep in range(args.repeats):
            res, wall = run_probes(st, cfg, reward, 1 + rep)
            s = res.stats
            est_states = unique_states(st, res.potentials)
            adv = advantages(st, res.potentials)
            acc["decode"] += s["probe/tokens"]
            acc["prefill"] += s["probe/computed_prompt_tokens"]
            acc["wall"] += wall
            acc["rounds"] += s["probe/rounds"]
            acc["samples"] += s["probe/samples_per_state"]
            acc["phi_mse"] += float(((est_states - gt_states) ** 2).mean())
            acc["adv_mse"] += float(((adv - gt_adv) ** 2).mean())
            acc["sign"] += float((torch.sign(adv) == torch.sign(gt_adv)).double().mean())
        row = {k: v / args.repeats for k, v in acc.items()}
        rule = cfg.rule()
        if rule is None:
            from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule

            rule = AdaptiveProbeRule(cfg.num_probes, 1, cfg.num_probes, 0.0)
        row["exp_samples"], row["exp_phi_mse"], row["exp_adv_mse"] = expected_advantage_mse(rule, gt_states, jac)
        rows[spec] = row
        print(f"{spec:<22} decode {row['decode']:8.0f}  prefill {row['prefill']:8.0f}  wall {row['wall']:6.1f} s  "
              f"rounds {row['rounds']:.1f}  samples/state {row['samples']:5.2f} (exp {row['exp_samples']:5.2f})  "
              f"phi_mse {row['phi_mse']:.4f} (exp {row['exp_phi_mse']:.4f})  adv_mse {row['adv_mse']:.5f} "
              f"(exp {row['exp_adv_mse']:.5f})  "
              f"sign {row['sign']:.3f}", flush=True)
    reward.close()
    st.group.shutdown()
    d, f8 = rows[args.default], rows["fixed:8"]
    print(f"default {args.default} vs fixed:8 (mean of {args.repeats} repeats; machine shared, wall times noisy): "
          f"prefill ratio {d['prefill'] / f8['prefill']:.2f}, wall ratio {d['wall'] / f8['wall']:.2f}, "
          f"expected samples ratio {d['exp_samples'] / f8['exp_samples']:.2f}, expected Phi MSE ratio "
          f"{d['exp_phi_mse'] / f8['exp_phi_mse']:.2f}, expected advantage MSE ratio {d['exp_adv_mse'] / f8['exp_adv_mse']:.2f} "
          f"(measured with the ground truth's noise removed: "
          f"{(d['adv_mse'] - gt_adv_noise) / max(f8['adv_mse'] - gt_adv_noise, 1e-12):.2f})")
    v = gt_states * (1 - gt_states)
    r_tok = d["exp_samples"] / f8["exp_samples"]
    if float(v.sum()) > 0:  # no rule can beat the best fixed allocation of the same budget by much
        oracle = float(v.sqrt().mean() ** 2 / v.mean()) / r_tok
        print(f"oracle allocation (n_s proportional to sqrt(Phi_s (1 - Phi_s)), true Phi known, unbiased) at the "
              f"default's expected token ratio {r_tok:.2f}: Phi-MSE ratio {oracle:.2f}")
    print(f"adaptive: probe_tokens_ratio={d['decode'] / f8['decode']:.2f} advantage_mse_ratio={d['adv_mse'] / f8['adv_mse']:.2f}")


if __name__ == "__main__":
    main()
