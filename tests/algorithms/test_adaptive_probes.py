"""Adaptive probe stopping rule: schedule, exact stopping distribution (checked against brute force
over every score sequence), bias of the sample mean under optional stopping, the unbiased GMS
estimator, and the tol = 0 reduction to fixed m."""

import itertools
import math

import pytest

from openrlhf_shape.algorithms.adaptive_probes import (
    AdaptiveProbeRule,
    StateTally,
    estimator_moments,
    gms_estimate,
    jeffreys_posterior_sd,
    max_abs_bias,
    states_to_continue,
    stopping_outcomes,
)

RULES = [
    AdaptiveProbeRule(4, 4, 8, 0.13),
    AdaptiveProbeRule(4, 4, 12, 0.12),
    AdaptiveProbeRule(2, 3, 11, 0.15),
    AdaptiveProbeRule(3, 2, 9, 0.2),
]


def test_jeffreys_sd_values():
    assert jeffreys_posterior_sd(0, 0) == pytest.approx(math.sqrt(0.25 / 2))  # Beta(1/2, 1/2)
    assert jeffreys_posterior_sd(0, 4) == pytest.approx(math.sqrt(0.5 * 4.5 / (25 * 6)))
    assert jeffreys_posterior_sd(4, 8) == pytest.approx(math.sqrt(4.5 * 4.5 / (81 * 10)))
    assert jeffreys_posterior_sd(1, 4) == jeffreys_posterior_sd(3, 4)  # symmetric
    with pytest.raises(ValueError):
        jeffreys_posterior_sd(5, 4)


def test_checkpoints_and_validation():
    assert AdaptiveProbeRule(4, 4, 8, 0.13).checkpoints() == [4, 8]  # unanimous 4 can stop
    assert AdaptiveProbeRule(4, 4, 8, 0.12).checkpoints() == [8]  # nothing can stop at 4: one round
    assert AdaptiveProbeRule(4, 4, 16, 0.12).checkpoints() == [8, 12, 16]
    assert AdaptiveProbeRule(4, 4, 8, 0.0).checkpoints() == [8]  # tol 0: fixed m
    assert AdaptiveProbeRule(3, 4, 9, 0.2).checkpoints() == [3, 7, 9]  # the cap ends a short round
    with pytest.raises(ValueError, match="max_probes"):
        AdaptiveProbeRule(4, 4, 2, 0.1)
    with pytest.raises(ValueError, match="adaptive_tol"):
        AdaptiveProbeRule(4, 4, 8, 0.5)


def _brute_force(rule: AdaptiveProbeRule) -> dict[tuple[int, int], tuple[int, int]]:
    """Walk every 0/1 sequence of length cap through the rule sequentially."""
    cps = rule.checkpoints()
    out: dict[tuple[int, int], list[int]] = {}
    seen_prefix: set[tuple[int, ...]] = set()
    for seq in itertools.product((0, 1), repeat=rule.max_probes):
        for c in cps:
            s = sum(seq[:c])
            if c == rule.max_probes or rule.can_stop(s, c):
                prefix = seq[:c]
                if prefix not in seen_prefix:  # count distinct stopped paths, not their extensions
                    seen_prefix.add(prefix)
                    a = out.setdefault((c, s), [0, 0])
                    a[0] += 1
                    a[1] += prefix[0]
                break
    return {k: (v[0], v[1]) for k, v in out.items()}


@pytest.mark.parametrize("rule", RULES)
def test_stopping_outcomes_equal_brute_force(rule):
    got = {(p.n, p.successes): (p.paths, p.paths_first_success) for p in stopping_outcomes(rule)}
    assert got == _brute_force(rule)
    for p in (0.0, 0.13, 0.5, 0.9, 1.0):
        total = sum(pt.paths * p**pt.successes * (1 - p) ** (pt.n - pt.successes) for pt in stopping_outcomes(rule))
        assert total == pytest.approx(1.0, abs=1e-12)


def test_default_rule_closed_form_and_bias():
    rule = AdaptiveProbeRule(4, 4, 8, 0.13)  # stops at 4 exactly when unanimous
    for p in (0.05, 0.2, 0.5, 0.8):
        m = estimator_moments(rule, p)
        p_stop = (1 - p) ** 4 + p**4
        assert m["expected_samples"] == pytest.approx(8 - 4 * p_stop)
        # bias, by hand: E[s/n] - p where the first-round outcome decides n
        e = p**4 * 1.0
        for s4 in range(1, 4):
            pr4 = math.comb(4, s4) * p**s4 * (1 - p) ** (4 - s4)
            e += pr4 * (s4 + 4 * p) / 8
        assert m["bias"] == pytest.approx(e - p, abs=1e-12)
    assert estimator_moments(rule, 0.2)["bias"] < -0.03  # shrinks towards the nearer end
    assert estimator_moments(rule, 0.5)["bias"] == pytest.approx(0.0, abs=1e-12)
    worst, at = max_abs_bias(rule)
    assert 0.035 < worst < 0.045 and 0.1 < at < 0.3


@pytest.mark.parametrize("rule", RULES)
def test_gms_estimator_is_exactly_unbiased(rule):
    for p in (0.03, 0.2, 0.5, 0.77):
        assert estimator_moments(rule, p, "gms")["bias"] == pytest.approx(0.0, abs=1e-12)
    assert all(0.0 <= gms_estimate(pt) <= 1.0 for pt in stopping_outcomes(rule))


def test_tol_zero_is_fixed_m():
    rule = AdaptiveProbeRule(4, 4, 8, 0.0)
    for p in (0.1, 0.6):
        m = estimator_moments(rule, p)
        assert m["expected_samples"] == pytest.approx(8)
        assert m["bias"] == pytest.approx(0.0, abs=1e-12)
        assert m["mse"] == pytest.approx(p * (1 - p) / 8)


def test_tallies_and_continue():
    rule = AdaptiveProbeRule(4, 4, 8, 0.13)
    t = [StateTally(), StateTally(), StateTally()]
    t[0].add([0, 0, 0, 0])
    t[1].add([1, 0, 0, 0])
    t[2].add([1, 1, 1, 1])
    assert states_to_continue(rule, t) == [1]
    t[1].add([0, 0, 0, 1])
    assert states_to_continue(rule, t) == [] and t[1].estimate() == 0.25
    with pytest.raises(ValueError):
        StateTally().estimate()
