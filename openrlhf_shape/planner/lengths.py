"""Response lengths of a rollout batch as a distribution, not one number: a lognormal cut at the cap.

A response's length is ``min(L, cap)`` with ``L ~ LogNormal(mu, sigma)`` and ``cap = --rollout.max_new_tokens``
(the engine stops there: the response is truncated). ``mean`` (``--plan.mean_response_tokens``) is the mean of
the *cut* lengths, what a run logs; ``mu`` is solved for it. ``sigma`` (``--plan.response_length_sigma``) sets the
tail: 0 is every response at the mean.

Closed forms (``Phi`` the standard normal CDF, ``z_p`` its quantile):

* mean of the cut lengths ``E[min(L, c)] = e^(mu + sigma^2/2) Phi((ln c - mu - sigma^2)/sigma) + c (1 - Phi((ln c - mu)/sigma))``;
* quantile ``q(p) = min(c, e^(mu + sigma z_p))``;
* the longest of ``n`` responses (the slowest sample, which bounds a synchronous batch): ``q(n / (n + 1))``, the
  usual plotting position of the largest of ``n`` draws;
* a batch's lengths, deterministically: ``q((i + 1/2) / n)`` for ``i = 0..n-1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

_N = NormalDist()


@dataclass(frozen=True)
class ResponseLengths:
    """``min(LogNormal(mu, sigma), cap)`` in tokens; build it with :meth:`from_mean`."""

    mu: float
    sigma: float
    cap: int

    @classmethod
    def from_mean(cls, mean: float, sigma: float, cap: int) -> "ResponseLengths":
        """The distribution whose cut lengths average ``mean`` tokens (``0 < mean < cap``; ``mean >= cap``: every
        response runs to the cap)."""
        if sigma < 0:
            raise ValueError(f"--plan.response_length_sigma must be >= 0, got {sigma}")
        if cap < 1 or mean <= 0:
            raise ValueError(f"response lengths need mean > 0 and a cap >= 1 (got mean {mean}, cap {cap})")
        if sigma == 0 or mean >= cap:
            return cls(math.log(min(mean, cap)), 0.0, cap)
        lo, hi = math.log(mean) - 10 * sigma - 10, math.log(cap) + 10 * sigma + 10
        for _ in range(200):  # the cut mean rises with mu: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cls(mid, sigma, cap).mean() < mean else (lo, mid)
        return cls((lo + hi) / 2, sigma, cap)

    def mean(self) -> float:
        """``E[min(L, cap)]`` in tokens (module doc)."""
        if self.sigma == 0:
            return min(math.exp(self.mu), self.cap)
        a = (math.log(self.cap) - self.mu) / self.sigma
        return math.exp(self.mu + self.sigma ** 2 / 2) * _N.cdf(a - self.sigma) + self.cap * (1 - _N.cdf(a))

    def quantile(self, p: float) -> float:
        """Tokens below which a share ``p`` of the responses end (``0 < p < 1``)."""
        if self.sigma == 0:
            return min(math.exp(self.mu), self.cap)
        return min(float(self.cap), math.exp(self.mu + self.sigma * _N.inv_cdf(p)))

    def truncated_share(self) -> float:
        """Share of the responses that reach the cap."""
        if self.sigma == 0:
            return 1.0 if math.exp(self.mu) >= self.cap else 0.0
        return 1 - _N.cdf((math.log(self.cap) - self.mu) / self.sigma)

    def longest(self, n: int) -> float:
        """The expected longest of ``n`` responses: ``q(n / (n + 1))`` tokens."""
        return self.quantile(n / (n + 1))

    def batch(self, n: int) -> list[int]:
        """``n`` lengths spread over the distribution, ``q((i + 1/2) / n)`` rounded, at least 1 token each."""
        return [max(1, round(self.quantile((i + 0.5) / n))) for i in range(n)]

    def describe(self) -> str:
        return (f"lognormal sigma {self.sigma:g} cut at {self.cap}: mean {self.mean():,.0f}, median "
                f"{self.quantile(0.5):,.0f}, p99 {self.quantile(0.99):,.0f}, {100 * self.truncated_share():.1f}% truncated")
