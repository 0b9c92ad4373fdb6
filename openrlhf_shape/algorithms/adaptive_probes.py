"""Adaptive probe budget: when to stop probing a state, and what that does to the estimate.

A state's potential Phi = P(verifier says correct | forced answer from the state) is estimated from
Bernoulli probe scores. Fixed m spends as much on a state whose probes all fail as on an
uncertain one. The adaptive rule probes in rounds: checkpoints ``n_1 < n_2 < ... < n_J = cap``
(``first_round``, then ``round_size`` more each time, capped at ``max_probes``). After each round a
state with ``s`` successes out of ``n`` stops when its posterior standard deviation under the
Jeffreys prior, ``sd(Beta(s + 1/2, n - s + 1/2))``, is at most ``tol``; it always stops at the cap.
The estimate is the sample mean ``s / n``.

Checkpoints where no ``s`` could stop are dropped (they would only add a round), so ``tol = 0``
leaves the single checkpoint ``cap``: exactly the fixed-m estimator with m = cap.

Optional stopping biases the sample mean: stopping on "all 4 failed" for a state with Phi = 0.1
reports 0 more often than it should. :func:`stopping_outcomes` enumerates every stopping point
(n, s) with its number of score paths, so bias and MSE at any Phi are exact sums
(:func:`estimator_moments`). ``docs/adaptive_probes.md`` tabulates them for the defaults. (The
Girshick-Mosteller-Savage estimator, paths from (1, 1) over paths from (0, 0), is exactly
unbiased for any such rule, but its MSE is larger than the sample mean's for these rules: it
reduces to the mean of the first round alone when only unanimity stops. ``gms_estimate`` is
kept for the comparison in the docs and tests.)

Pure python / torch; no vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


def jeffreys_posterior_sd(successes: int, n: int) -> float:
    """Standard deviation of Beta(s + 1/2, n - s + 1/2), the Jeffreys posterior of a Bernoulli rate
    after ``successes`` out of ``n`` (n >= 0)."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    a, b = successes + 0.5, n - successes + 0.5
    return math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))


@dataclass(frozen=True)
class AdaptiveProbeRule:
    """Stopping rule for one probed state.

    first_round: probe samples in the first round (>= 1).
    round_size: samples added per later round (>= 1).
    max_probes: cap on samples per state (>= first_round).
    tol: stop once the Jeffreys posterior sd is <= tol (probability units; 0 never stops early).
    """

    first_round: int = 4
    round_size: int = 5
    max_probes: int = 9
    tol: float = 0.13

    def __post_init__(self) -> None:
        if self.first_round < 1:
            raise ValueError(f"--probe.adaptive_first_round must be >= 1, got {self.first_round}")
        if self.round_size < 1:
            raise ValueError(f"--probe.adaptive_round_size must be >= 1, got {self.round_size}")
        if self.max_probes < self.first_round:
            raise ValueError(
                f"--probe.max_probes ({self.max_probes}) must be >= --probe.adaptive_first_round ({self.first_round})"
            )
        if not 0.0 <= self.tol < 0.5:
            raise ValueError(f"--probe.adaptive_tol must lie in [0, 0.5) (a posterior sd), got {self.tol}")

    def can_stop(self, successes: int, n: int) -> bool:
        """True when a state with ``successes`` of ``n`` needs no more samples."""
        return n >= self.max_probes or jeffreys_posterior_sd(successes, n) <= self.tol

    def checkpoints(self) -> list[int]:
        """Cumulative sample counts after each round, ending at ``max_probes``; counts at which no
        outcome could stop are merged into the next round."""
        raw, n = [], self.first_round
        while n < self.max_probes:
            raw.append(n)
            n += self.round_size
        useful = [c for c in raw if any(self.can_stop(s, c) for s in range(c + 1))]
        return [*useful, self.max_probes]


@dataclass(frozen=True)
class StoppingPoint:
    """A place the rule stops: n samples with s successes; ``paths`` score sequences reach it
    (without stopping earlier), ``paths_first_success`` of them start with a success."""

    n: int
    successes: int
    paths: int
    paths_first_success: int


@lru_cache(maxsize=64)
def _stopping_outcomes(rule: AdaptiveProbeRule) -> tuple[StoppingPoint, ...]:
    cps = rule.checkpoints()
    # live[(s)] = (paths, paths starting with a success) at the previous checkpoint, not yet stopped
    live: dict[int, tuple[int, int]] = {0: (1, 0)}
    prev = 0
    out: list[StoppingPoint] = []
    for c in cps:
        k = c - prev
        nxt: dict[int, tuple[int, int]] = {}
        for s, (paths, first1) in live.items():
            for j in range(k + 1):
                w = math.comb(k, j)
                if prev == 0:  # the first draw is in this block
                    f = math.comb(k - 1, j - 1) if j >= 1 else 0
                else:
                    f = first1 * w
                p0, f0 = nxt.get(s + j, (0, 0))
                nxt[s + j] = (p0 + paths * w, f0 + f)
        live = {}
        for s, (paths, first1) in sorted(nxt.items()):
            if rule.can_stop(s, c):
                out.append(StoppingPoint(c, s, paths, first1))
            else:
                live[s] = (paths, first1)
        prev = c
    return tuple(out)


def stopping_outcomes(rule: AdaptiveProbeRule) -> list[StoppingPoint]:
    """Every stopping point of ``rule`` with its path counts (exact integers). The probability of
    stopping at (n, s) when each probe succeeds with probability p is
    ``paths * p**s * (1 - p)**(n - s)``; these sum to 1 for every p."""
    return list(_stopping_outcomes(rule))


def gms_estimate(point: StoppingPoint) -> float:
    """Girshick-Mosteller-Savage estimate at a stopping point: exactly unbiased for p."""
    return point.paths_first_success / point.paths


def estimator_moments(rule: AdaptiveProbeRule, p: float, estimator: str = "mean") -> dict[str, float]:
    """Exact expected samples, bias and MSE of the estimate when the true potential is ``p``.

    estimator: ``mean`` (s / n, what the probes report) or ``gms`` (unbiased, for comparison).
    Returns {"expected_samples", "bias", "mse"}.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    if estimator not in ("mean", "gms"):
        raise ValueError(f"estimator must be 'mean' or 'gms', got {estimator!r}")
    en = bias = mse = 0.0
    for pt in stopping_outcomes(rule):
        prob = pt.paths * p**pt.successes * (1.0 - p) ** (pt.n - pt.successes)
        est = pt.successes / pt.n if estimator == "mean" else gms_estimate(pt)
        en += prob * pt.n
        bias += prob * (est - p)
        mse += prob * (est - p) ** 2
    return {"expected_samples": en, "bias": bias, "mse": mse}


def max_abs_bias(rule: AdaptiveProbeRule, grid: int = 201) -> tuple[float, float]:
    """(max |bias| of the sample mean over p on a uniform grid of [0, 1], the p where it occurs)."""
    best = (0.0, 0.0)
    for i in range(grid):
        p = i / (grid - 1)
        b = abs(estimator_moments(rule, p)["bias"])
        if b > best[0]:
            best = (b, p)
    return best


@dataclass
class StateTally:
    """Running counts of one probed state: ``n`` samples so far, ``successes`` among them."""

    n: int = 0
    successes: float = 0.0

    def add(self, scores: list[float]) -> None:
        self.n += len(scores)
        self.successes += float(sum(scores))

    def estimate(self) -> float:
        """The sample mean s / n (the reported potential)."""
        if self.n == 0:
            raise ValueError("no probe samples for this state")
        return self.successes / self.n


def states_to_continue(rule: AdaptiveProbeRule, tallies: list[StateTally]) -> list[int]:
    """Indices of states that need another round (binary scores: successes are whole numbers)."""
    return [i for i, t in enumerate(tallies) if not rule.can_stop(int(round(t.successes)), t.n)]
