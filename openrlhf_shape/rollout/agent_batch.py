"""What OpenRLHF agent executors return (:mod:`openrlhf_shape.rollout.agents` runs them) -> one step's
:class:`~openrlhf_shape.batch.ExperienceBatch`.

Per episode an executor returns a dict (OpenRLHF 0.11's ``openrlhf.utils.agent``): ``observation_tokens``
(the prompt, then the policy's turns and the environment's replies, in order), ``action_ranges`` (``[start,
end)`` of each policy turn in those tokens), ``reward`` and ``scores`` (numbers or one-element tensors; None
leaves the outcome to the reward function, as OpenRLHF leaves it to its reward model), ``rollout_log_probs``
(one per token, 0 outside the turns; or None), ``truncated`` (the last generation hit its token limit: what
``--reward.stop_properly_penalty_coef`` penalises, as in OpenRLHF) and
``extra_logs`` (name -> number or tensor, of which OpenRLHF logs the first element; the step logs their mean
over the episodes that report it, as ``agent/<name>``).

As OpenRLHF's rollout does, tokens past ``max_length`` are cut and the turns with them. The prompt of a sample
is everything before its first turn (the observation after ``reset``), its response everything after: the
turns, and the replies between and after them, which the ``action_mask`` marks as not the policy's.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from openrlhf_shape.batch import ExperienceBatch, length_mask, pad_rows
from openrlhf_shape.rollout.agents import FLAG, AgentError, BatchStats


@dataclass
class Episode:
    """One executed episode. ``action_mask`` / ``rollout_log_probs``: one entry per response token."""

    item: Any
    sequence: list[int]
    prompt_len: int
    action_mask: list[bool]
    rollout_log_probs: list[float] | None
    reward: float | None
    score: float | None
    extra_logs: dict[str, float]
    truncated: bool
    turns: int

    @property
    def response_len(self) -> int:
        return len(self.sequence) - self.prompt_len

    @property
    def env_tokens(self) -> int:
        return self.response_len - sum(self.action_mask)


def _number(value: Any, what: str, first_only: bool = False) -> float | None:
    """A number, a bool or a (one-element, unless ``first_only``) tensor / array -> float; None stays None."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().reshape(-1).tolist()
    elif hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value or (len(value) > 1 and not first_only):
            raise AgentError(f"{FLAG}: {what} must be one number per episode, got {len(value)} values")
        value = value[0]
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        return float(value)
    raise AgentError(f"{FLAG}: {what} must be a number or a one-element tensor, got {type(value).__name__}")


def parse_episode(out: dict, item: Any, max_length: int, episode: int) -> Episode:
    """One executor output -> :class:`Episode`, cut at ``max_length`` tokens as OpenRLHF's rollout cuts it."""
    for key in ("observation_tokens", "action_ranges"):
        if key not in out:
            raise AgentError(f"{FLAG}: episode {episode}'s output has no {key!r} (keys {sorted(out)}); return "
                             "what OpenRLHF's MultiTurnAgentExecutor.execute returns")
    tokens = [int(t) for t in out["observation_tokens"]]
    ranges = sorted((int(a), int(b)) for a, b in out["action_ranges"] if int(b) > int(a))
    if not ranges:
        raise AgentError(f"{FLAG}: episode {episode} holds no action (empty action_ranges): the agent never let "
                         "the policy generate; check its step() and --data.max_prompt_len / --rollout.max_new_tokens")
    mask, last_end = [False] * len(tokens), 0  # [len(tokens)]: True inside the (disjoint) action ranges
    for start, end in ranges:
        if not last_end <= start <= end <= len(tokens):
            raise AgentError(f"{FLAG}: episode {episode} has action range {(start, end)} outside its "
                             f"{len(tokens)} observation tokens, or overlapping / out of order ({ranges})")
        mask[start:end], last_end = [True] * (end - start), end
    mask = mask[:max_length]
    tokens, plen = tokens[:max_length], ranges[0][0]
    if plen < 1:
        raise AgentError(f"{FLAG}: episode {episode}'s first action starts at token 0: the observation after "
                         "reset() is empty; the prompt must hold at least one token")
    if plen >= len(tokens):
        raise AgentError(f"{FLAG}: episode {episode}'s first action starts at token {plen}, past max_length "
                         f"{max_length}; raise --rollout.max_new_tokens or shorten the prompt")
    lps = out.get("rollout_log_probs")
    lps = [float(x) for x in lps[plen:len(tokens)]] if lps is not None and len(lps) >= len(tokens) else None
    extra = {str(k): _number(v, f"extra_logs[{k!r}]", first_only=True) for k, v in (out.get("extra_logs") or {}).items()}
    reward = _number(out.get("reward"), "reward")
    score = _number(out.get("scores"), "scores")
    return Episode(item=item, sequence=tokens, prompt_len=plen, action_mask=mask[plen:], rollout_log_probs=lps,
                   reward=reward, score=reward if score is None else score,
                   extra_logs={k: v for k, v in extra.items() if v is not None}, truncated=bool(out.get("truncated")),
                   turns=sum(1 for a, _ in ranges if a < len(tokens)))


def _outcomes(episodes: Sequence[Episode]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(rewards [B], scores [B])`` when every episode has a reward; ``(None, None)`` when none has one."""
    given = [e.reward is not None for e in episodes]
    if not any(given):
        return None, None
    if not all(given):
        raise AgentError(f"{FLAG}: {given.count(False)} of {len(given)} episodes returned no reward; an agent gives "
                         "every episode a reward, or none (then the reward function scores them)")
    return (torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            torch.tensor([e.score for e in episodes], dtype=torch.float32))


def episodes_to_batch(episodes: Sequence[Episode], tokenizer) -> ExperienceBatch:
    """The step's :class:`ExperienceBatch`: sequences, ``response_mask`` and ``action_mask`` ``[B, T]``, the
    engines' log-probs ``[B, T]`` (when every episode has them), and the agents' rewards / scores ``[B]``."""
    lengths = [e.response_len for e in episodes]
    width = max(lengths)
    rollout_lp = None
    if all(e.rollout_log_probs is not None for e in episodes):
        rollout_lp = pad_rows([torch.tensor(e.rollout_log_probs, dtype=torch.float32) for e in episodes], width)
    rewards, scores = _outcomes(episodes)
    return ExperienceBatch(
        items=[e.item for e in episodes], sequences=[e.sequence for e in episodes],
        prompt_lens=[e.prompt_len for e in episodes],
        texts=[tokenizer.decode(e.sequence[e.prompt_len:], skip_special_tokens=True) for e in episodes],
        response_mask=length_mask(lengths, width), rollout_log_probs=rollout_lp, rewards=rewards, scores=scores,
        action_mask=pad_rows([torch.tensor(e.action_mask, dtype=torch.bool) for e in episodes], width, torch.bool),
        truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),  # --reward.stop_properly_penalty_coef
    )


def agent_metrics(episodes: Sequence[Episode], stats: BatchStats) -> dict[str, Any]:
    """The generate phase's metrics for an agent rollout (``rollout/*`` as a single-turn rollout logs them,
    the policy's tokens counted as ``rollout/tokens``; ``agent/*`` for turns, replies, batching, extra logs)."""
    lengths = torch.tensor([e.response_len for e in episodes], dtype=torch.float32)
    policy = float(sum(sum(e.action_mask) for e in episodes))
    env = float(sum(e.env_tokens for e in episodes))
    turns = torch.tensor([e.turns for e in episodes], dtype=torch.float32)
    metrics: dict[str, Any] = {
        "rollout/response_length/mean": float(lengths.mean()), "rollout/response_length/max": float(lengths.max()),
        "rollout/response_lengths": [int(x) for x in lengths.tolist()],
        "rollout/truncated_rate": sum(e.truncated for e in episodes) / len(episodes),
        "rollout/tokens": policy, "rollout/tokens_per_s": policy / max(stats.seconds, 1e-9),
        "agent/turns/mean": float(turns.mean()), "agent/turns/max": float(turns.max()),
        "agent/env_tokens": env, "agent/env_token_share": env / max(env + policy, 1.0),
        "agent/engine_calls": float(stats.engine_calls), "agent/requests": float(stats.requests),
        "agent/partial_batches": float(stats.partial_batches),
    }
    names = sorted({k for e in episodes for k in e.extra_logs})
    for k in names:
        vals = [e.extra_logs[k] for e in episodes if k in e.extra_logs]
        metrics[k if "/" in k else f"agent/{k}"] = float(sum(vals) / len(vals)) if vals else math.nan
    return metrics
