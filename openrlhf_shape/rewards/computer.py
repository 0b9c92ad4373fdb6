"""One front door for outcome rewards: Math-Verify (default), an OpenRLHF reward plug-in or a reward model's ranks
(``--reward.model_name_or_path``, bound by :meth:`RewardComputer.attach_model`: it scores token ids), for the answers
(:meth:`RewardComputer.compute`) and for SHAPE/MRT's probes (:meth:`RewardComputer.score_probes`).

The probes' forced answers take the answer's reward path, so Phi_0..Phi_{K-1} and Phi_K = R come from one
verifier: Math-Verify (with the probe cache and exact shortcuts of ``probe_scoring.py``), or the plug-in, which
gets OpenRLHF's arguments for each probe sample as for an answer (see :meth:`RewardComputer.score_probes`).
``--probe.scorer math_verify`` keeps Math-Verify for the probes whatever judges the answer.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer
from openrlhf_shape.rewards.plugin import load_reward_fn, mean_extra_logs
from openrlhf_shape.rewards.probe_scoring import DedupProbeScorer, ProbeAnswers

# A reward model's scores of token sequences (prompt + response ids each) -> [N] float32, normalised when asked.
ModelScores = Callable[[Sequence[Sequence[int]]], torch.Tensor]

# Probe samples per plug-in call: a step's probes (B x K x m, each query a whole response prefix) go out in
# calls of at most this many, one HTTP request per endpoint each, so no request body grows with the step.
PROBE_CHUNK = 512


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
    # A reward model (OpenRLHF's format, actor/value_model.py) on ranks of its own: it scores the sampled token ids.
    model_name_or_path: str | None = None
    num_nodes: int | None = None  # its ranks = num_nodes x num_gpus_per_node (both unset: as many as the actor's)
    num_gpus_per_node: int | None = None
    normalize_enable: bool = False  # (score - mean) / std with config.json's mean/std, as OpenRLHF's reward model
    offload: bool = False  # its parameters in host memory except during its own forward, colocated or not

    def world_size(self, actor_world: int) -> int:
        """Reward-model ranks; ``actor_world`` when neither flag is given (one unset: 1 node / 8 GPUs per node)."""
        if self.num_nodes is None and self.num_gpus_per_node is None:
            return actor_world
        return (self.num_nodes or 1) * (self.num_gpus_per_node or 8)


class RewardComputer:
    """compute(queries, prompts, labels) -> {"rewards": float32 [N], "scores": float32 [N], "extra_logs"}
    where extra_logs maps metric names to floats (a plug-in's per-sample values are averaged).

    With Math-Verify the response is ``query[len(prompt):]`` when the query starts with its prompt
    (OpenRLHF passes prompt + response as the query), else the whole query; pass ``responses=`` to
    give them directly. ``score_probes(answers)`` scores probe samples on the same reward path;
    ``score(texts, labels)`` is Math-Verify alone (``--probe.scorer math_verify``, the held-out set of the
    ``openrlhf-shape eval`` tool).
    """

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self.plugin = None
        self.scorer: MathVerifyScorer | None = None
        self._probe_scorer: DedupProbeScorer | None = None
        self.probe_chunk = PROBE_CHUNK
        self.model: ModelScores | None = None  # --reward.model_name_or_path: bound by attach_model once ranks run
        self.squash = False  # SHAPE/MRT with a reward model: sigmoid(score) makes R a value in [0, 1]
        if self.cfg.model_name_or_path:
            return  # the reward model judges answers and probes; Math-Verify starts only for --probe.scorer math_verify
        if self.cfg.remote_url:
            self.plugin = load_reward_fn(
                self.cfg.remote_url, timeout_s=self.cfg.remote_timeout_s, retries=self.cfg.remote_retries
            )
        else:
            self.scorer = MathVerifyScorer(
                num_workers=self.cfg.num_workers, timeout_s=self.cfg.timeout_s, max_chars=self.cfg.max_chars
            )

    def _math_verify(self) -> MathVerifyScorer:
        if self.scorer is None:  # plug-in mode: started only for --probe.scorer math_verify
            self.scorer = MathVerifyScorer(
                num_workers=self.cfg.num_workers, timeout_s=self.cfg.timeout_s, max_chars=self.cfg.max_chars
            )
        return self.scorer

    def score(self, texts: list[str], labels: list[str], cache: dict | None = None) -> list[float]:
        """Math-Verify 1.0/0.0 per text (the probes' Math-Verify path). With ``fast_probe_scoring``
        each distinct (extracted answer, label) is verified once (``cache`` carries verdicts across
        calls of one step) and canonical integers skip Math-Verify: same scores, see
        :mod:`openrlhf_shape.rewards.probe_scoring`."""
        if not self.cfg.fast_probe_scoring:
            return self._math_verify().score(texts, labels)
        if self._probe_scorer is None or self._probe_scorer.pool is not self._math_verify():
            self._probe_scorer = DedupProbeScorer(self._math_verify())
        return self._probe_scorer.score(texts, labels, cache=cache)

    def attach_model(self, scores: ModelScores, squash: bool) -> None:
        """Bind the reward model's ranks (``--reward.model_name_or_path``): ``scores`` maps token sequences to their
        (normalised) scores ``[N]``; ``squash`` maps each through a sigmoid (SHAPE/MRT need R in [0, 1])."""
        self.model, self.squash = scores, bool(squash)

    def _model_rewards(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """The reward model's reward of each token sequence, sigmoid-squashed under :attr:`squash`."""
        if self.model is None:
            raise RuntimeError("--reward.model_name_or_path: the reward model's ranks are not bound yet (attach_model)")
        out = self.model([list(s) for s in sequences]).float()
        return (torch.sigmoid(out) if self.squash else out).tolist()

    def score_probes(self, answers: ProbeAnswers, cache: MutableMapping | None = None,
                     verifier: str = "reward") -> list[float]:
        """One value per probe sample, on the scale of the outcome R: the probe potential's terms.

        ``verifier="reward"``: the answer's reward path. Math-Verify (no plug-in, no reward model): :meth:`score` on
        the forced answers. A reward model: its (squashed) reward of each distinct sample's token ids
        (``answers.sequence``). A plug-in: its ``rewards`` (what R is made of; ``scores`` only filter and log) for the
        query of each distinct sample (``answers.keys``; ``cache`` carries them across the rounds of a step), in calls
        of at most ``probe_chunk`` samples, clamped into ``--reward.clip_range`` as R is; a value outside [0, 1]
        after that is refused, as for R. Its extra logs are dropped (they would mix into the answers' metrics).
        ``verifier="math_verify"``: Math-Verify whatever judges the answer (``--probe.scorer math_verify``)."""
        if verifier not in ("reward", "math_verify"):
            raise ValueError(f"score_probes: verifier must be 'reward' or 'math_verify', got {verifier!r}")
        if verifier == "math_verify" or (self.plugin is None and self.model is None):
            return self.score(answers.texts, answers.labels, cache=cache)
        if self.model is not None and answers.sequence is None:
            raise ValueError("score_probes: a reward model judges probe samples by their token ids; the caller gave "
                             "none (rollout/probes.py:estimate_potentials needs prompts=)")
        if self.model is None and (answers.query is None or answers.prompts is None):
            raise ValueError("score_probes: a reward plug-in judges probe samples by their queries and prompts; "
                             "the caller gave none (rollout/probes.py:estimate_potentials needs prompts=)")
        if answers.keys is None:  # no identities: every sample is sent, nothing is kept across calls
            cache, keys = {}, list(range(len(answers.texts)))
        else:
            cache, keys = ({} if cache is None else cache), answers.keys
        todo: dict = {}  # key -> the sample whose query is sent for it
        for j, k in enumerate(keys):
            if k not in cache and k not in todo:
                todo[k] = j
        sent = list(todo.values())
        for start in range(0, len(sent), self.probe_chunk):
            part = sent[start : start + self.probe_chunk]
            for j, value in zip(part, self._judge_probes(answers, part)):
                cache[keys[j]] = value
        return [cache[k] for k in keys]

    def _judge_probes(self, answers: ProbeAnswers, part: list[int]) -> list[float]:
        """Probe samples ``part`` judged by the reward model (squashed as R) or the plug-in (clipped, in [0, 1])."""
        if self.model is not None:
            return self._model_rewards([answers.sequence(j) for j in part])
        lo, hi = self.cfg.clip_range
        out = self.plugin([answers.query(j) for j in part], [answers.prompts[j] for j in part],
                          [answers.labels[j] for j in part])
        values = []
        for r in out["rewards"]:
            value = min(max(float(r), lo), hi)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"--reward.remote_url gave a probe's forced answer the reward {r} (clipped to {value} by "
                    "--reward.clip_range): potentials estimate the expected outcome R, which SHAPE/MRT need in "
                    "[0, 1]. Rescale the reward function, or judge the probes with Math-Verify "
                    "(--probe.scorer math_verify)")
            values.append(value)
        return values

    def compute(
        self, queries: list[str], prompts: list[str], labels: list[str], responses: list[str] | None = None,
        sequences: Sequence[Sequence[int]] | None = None, **kw
    ) -> dict:
        """``sequences``: each sample's prompt + response token ids, as sampled (a reward model scores them)."""
        n = len(queries)
        if len(prompts) != n or len(labels) != n or (responses is not None and len(responses) != n):
            raise ValueError("compute: queries, prompts, labels (and responses) must have the same length")
        if self.model is not None:  # OpenRLHF: the reward model's (normalised) score is both reward and score
            if sequences is None or len(sequences) != n:
                raise ValueError("compute: a reward model (--reward.model_name_or_path) scores token ids: pass "
                                 "sequences= (prompt + response ids of every sample)")
            rewards = self._model_rewards(sequences)
            scores, extra = list(rewards), {}
        elif self.plugin is not None:
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
