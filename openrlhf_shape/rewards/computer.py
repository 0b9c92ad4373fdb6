"""One front door for outcome rewards: Math-Verify (default) or an OpenRLHF reward plug-in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer
from openrlhf_shape.rewards.plugin import load_reward_fn, mean_extra_logs
from openrlhf_shape.rewards.probe_scoring import DedupProbeScorer


@dataclass
class RewardConfig:
    """remote_url: None -> Math-Verify; else a .py file with reward_func or http(s) endpoint(s),
    comma-separated. remote_timeout_s / remote_retries: per HTTP request (OpenRLHF: 180 s, 5 tries)."""

    remote_url: str | None = None
    num_workers: int = 0  # Math-Verify processes; 0 = one per core this process may use
    fast_probe_scoring: bool = True  # probes: distinct (answer, label) once, integers without Math-Verify
    timeout_s: float = 5.0
    max_chars: int = 20000
    remote_timeout_s: float = 180.0
    remote_retries: int = 4
    clip_range: tuple[float, float] = (-10.0, 10.0)  # rewards are clamped into it (OpenRLHF's --reward.clip_range)
    # Truncated responses (finish reason "length"): reward x coef (coef in [0, 1]) or = coef (coef < 0); None off.
    # Applied by the experience maker (algorithms/length_penalty.py), before the clip.
    stop_properly_penalty_coef: float | None = None


class RewardComputer:
    """compute(queries, prompts, labels) -> {"rewards": float32 [N], "scores": float32 [N], "extra_logs"}
    where extra_logs maps metric names to floats (a plug-in's per-sample values are averaged).

    With Math-Verify the response is ``query[len(prompt):]`` when the query starts with its prompt
    (OpenRLHF passes prompt + response as the query), else the whole query; pass ``responses=`` to
    give them directly. ``score(texts, labels)`` makes it usable as the probe scorer.
    """

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self.plugin = None
        self.scorer: MathVerifyScorer | None = None
        self._probe_scorer: DedupProbeScorer | None = None
        if self.cfg.remote_url:
            self.plugin = load_reward_fn(
                self.cfg.remote_url, timeout_s=self.cfg.remote_timeout_s, retries=self.cfg.remote_retries
            )
        else:
            self.scorer = MathVerifyScorer(
                num_workers=self.cfg.num_workers, timeout_s=self.cfg.timeout_s, max_chars=self.cfg.max_chars
            )

    def _math_verify(self) -> MathVerifyScorer:
        if self.scorer is None:  # plug-in mode still scores probes with Math-Verify
            self.scorer = MathVerifyScorer(
                num_workers=self.cfg.num_workers, timeout_s=self.cfg.timeout_s, max_chars=self.cfg.max_chars
            )
        return self.scorer

    def score(self, texts: list[str], labels: list[str], cache: dict | None = None) -> list[float]:
        """Math-Verify 1.0/0.0 per text (the probe scorer interface). With ``fast_probe_scoring``
        each distinct (extracted answer, label) is verified once (``cache`` carries verdicts across
        calls of one step) and canonical integers skip Math-Verify: same scores, see
        :mod:`openrlhf_shape.rewards.probe_scoring`."""
        if not self.cfg.fast_probe_scoring:
            return self._math_verify().score(texts, labels)
        if self._probe_scorer is None or self._probe_scorer.pool is not self._math_verify():
            self._probe_scorer = DedupProbeScorer(self._math_verify())
        return self._probe_scorer.score(texts, labels, cache=cache)


    def compute(
        self, queries: list[str], prompts: list[str], labels: list[str], responses: list[str] | None = None, **kw
    ) -> dict:
        n = len(queries)
        if len(prompts) != n or len(labels) != n or (responses is not None and len(responses) != n):
            raise ValueError("compute: queries, prompts, labels (and responses) must have the same length")
        if self.plugin is not None:
            out = self.plugin(queries, prompts, labels, **kw)
            rewards, scores, extra = out["rewards"], out["scores"], mean_extra_logs(out["extra_logs"])
        else:
            if responses is None:
                responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
            before = self.scorer.stats()
            rewards = self.scorer.score(responses, labels)
            scores = list(rewards)
            after = self.scorer.stats()
            extra = {f"reward/{k}": float(after[k] - before[k]) for k in ("timeouts", "errors", "truncated", "unparsed")}
        return {
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "scores": torch.tensor(scores, dtype=torch.float32),
            "extra_logs": extra,
        }

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None

    def __enter__(self) -> "RewardComputer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
