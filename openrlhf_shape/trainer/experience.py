"""The SHAPE experience maker: prompts -> a batch of experiences ready for the train step.

Order of work for one step (DESIGN.md section 2):
generate (vLLM) -> rewards -> [optional DAPO group filter] -> old log-probs + entropy (the actor)
-> segmentation -> potential probes (vLLM) -> advantages (SHAPE / MRT / GRPO) -> TCR.

The actor is anything with ``compute_logprobs_and_entropy(batch) -> {"log_probs", "entropy"}``
(lists of float32 ``[T_i]`` tensors in batch order): the Megatron actor group in training, a plain
Hugging Face forward (:class:`HFActor`) in light tests and tools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from openrlhf_shape.algorithms import ShapeConfig, boundaries_as_lists, compute_token_advantages, pad_potentials, segment_batch
from openrlhf_shape.algorithms.entropy import token_log_probs_and_entropy
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig, ProbeSuffixes, estimate_potentials


class LogProbActor(Protocol):
    def compute_logprobs_and_entropy(self, batch: dict) -> dict: ...


@dataclass
class ExperienceConfig:
    """What the experience maker needs from the training config."""

    shape: ShapeConfig
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    dynamic_filtering: bool = False
    probe_temperature: float = 1.0
    probe_top_p: float = 1.0
    think_suffix: str | None = None
    answer_suffix: str | None = None
    probe_adaptive: bool = False
    probe_adaptive_tol: float = 0.13
    probe_max_probes: int = 0
    probe_adaptive_first_round: int = 4
    probe_adaptive_round_size: int = 4

    def probe_config(self) -> ProbeConfig:
        kw: dict[str, Any] = dict(
            num_probes=self.shape.num_probes,
            max_tokens=self.shape.probe_max_tokens,
            temperature=self.probe_temperature,
            top_p=self.probe_top_p,
            adaptive=self.probe_adaptive,
            adaptive_tol=self.probe_adaptive_tol,
            max_probes=self.probe_max_probes,
            adaptive_first_round=self.probe_adaptive_first_round,
            adaptive_round_size=self.probe_adaptive_round_size,
        )
        if self.think_suffix:
            kw["think_suffix"] = self.think_suffix
        if self.answer_suffix:
            kw["answer_suffix"] = self.answer_suffix
        return ProbeConfig(**kw)


@dataclass
class ExperienceBatch:
    """Experiences of one step. Lists are per sample (prompt-major, n samples per prompt)."""

    sequences: list[list[int]]  # prompt + response ids
    prompt_lens: list[int]
    old_log_probs: list[torch.Tensor]  # [T_i]
    advantages: list[torch.Tensor]  # [T_i]
    rewards: torch.Tensor  # [B]
    prompt_indices: list[int]  # dataset row of each sample's prompt
    metrics: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few decoded samples for the log

    def __len__(self) -> int:
        return len(self.sequences)

    def as_train_batch(self, indices: Sequence[int], temperature: float) -> dict:
        """The worker's ``train_step`` batch for the samples at ``indices``."""
        return {
            "sequences": [self.sequences[i] for i in indices],
            "prompt_lens": [self.prompt_lens[i] for i in indices],
            "old_log_probs": [self.old_log_probs[i] for i in indices],
            "advantages": [self.advantages[i] for i in indices],
            "temperature": temperature,
        }


def delimiter_token_ids(tokenizer, delimiter: str) -> set[int]:
    """Ids whose decoded text contains ``delimiter`` (for the delimiter-segmentation ablation)."""
    ids = set()
    for tok_id in range(len(tokenizer)):
        if delimiter in tokenizer.decode([tok_id]):
            ids.add(tok_id)
    if not ids:
        raise ValueError(f"no token of this vocabulary contains the delimiter {delimiter!r} (--shape.delimiter)")
    return ids


def _pad(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.float()
        mask[i, : r.numel()] = True
    return out, mask


class ShapeExperienceMaker:
    """Turns a batch of prompt items into an :class:`ExperienceBatch`.

    Args:
        cfg: sampling / estimator settings.
        engines: an :class:`~openrlhf_shape.rollout.engine.EngineGroup` (rollouts and probes).
        actor: computes old log-probs and entropy (see module doc).
        reward: a :class:`~openrlhf_shape.rewards.computer.RewardComputer` (outcomes and probe scores).
        tokenizer: the policy's tokenizer (decoding, probe suffixes, delimiter ids).
    """

    def __init__(self, cfg: ExperienceConfig, engines, actor: LogProbActor, reward, tokenizer):
        self.cfg = cfg
        self.engines = engines
        self.actor = actor
        self.reward = reward
        self.tokenizer = tokenizer
        self.probe_cfg = cfg.probe_config()
        self.suffixes = ProbeSuffixes.from_tokenizer(tokenizer, self.probe_cfg) if cfg.shape.estimator != "grpo" else None
        self._delims = (
            delimiter_token_ids(tokenizer, cfg.shape.delimiter) if cfg.shape.segmentation == "delimiter" else None
        )

    def make_experience(self, items: Sequence) -> ExperienceBatch:
        """``items``: prompt items with ``index``, ``prompt``, ``prompt_ids``, ``label``."""
        cfg, shape = self.cfg, self.cfg.shape
        n = cfg.n_samples_per_prompt
        timings: dict[str, float] = {}
        metrics: dict[str, Any] = {}

        # 1. rollouts
        t0 = time.perf_counter()
        sampling = SamplingConfig(
            n=n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_new_tokens
        )
        gens = self.engines.generate([list(it.prompt_ids) for it in items], sampling)
        timings["generate"] = time.perf_counter() - t0
        if len(gens) != len(items) * n:
            raise RuntimeError(f"engines returned {len(gens)} samples for {len(items)} prompts x n={n}")
        sample_items = [items[g.prompt_index] for g in gens]
        responses = [list(g.token_ids) for g in gens]
        empty = [i for i, r in enumerate(responses) if not r]
        if empty:
            raise RuntimeError(f"vLLM returned empty responses for samples {empty[:5]}: check --rollout.max_new_tokens")

        # 2. outcome rewards
        t0 = time.perf_counter()
        texts = [g.text for g in gens]
        out = self.reward.compute(
            queries=[it.prompt + txt for it, txt in zip(sample_items, texts)],
            prompts=[it.prompt for it in sample_items],
            labels=[it.label for it in sample_items],
            responses=texts,
        )
        rewards = out["rewards"].float()
        scores = out["scores"].float()
        metrics.update(out.get("extra_logs", {}))
        timings["rewards"] = time.perf_counter() - t0
        if shape.estimator != "grpo" and ((rewards < 0) | (rewards > 1)).any():
            raise ValueError(
                "SHAPE/MRT use the outcome as the final potential, so rewards must lie in [0, 1]; the reward "
                "function (--reward.remote_url) returned values outside it. Rescale it, or use "
                "--algo.advantage.estimator grpo"
            )
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
        metrics["rollout/accuracy"] = float(scores.mean())
        metrics["rollout/reward/mean"] = float(rewards.mean())
        metrics["rollout/response_length/mean"] = float(lengths.mean())
        metrics["rollout/response_length/max"] = float(lengths.max())
        metrics["rollout/response_lengths"] = [int(x) for x in lengths.tolist()]
        metrics["rollout/truncated_rate"] = sum(g.finish_reason == "length" for g in gens) / len(gens)
        metrics["rollout/tokens"] = float(lengths.sum())
        metrics["rollout/tokens_per_s"] = float(lengths.sum()) / max(timings["generate"], 1e-9)
        grouped = rewards.view(-1, n)
        solved = (grouped.max(-1).values > 0).float()
        metrics["rollout/group_all_correct_rate"] = float((grouped.min(-1).values >= 1).float().mean())
        metrics["rollout/group_all_wrong_rate"] = float((1 - solved).mean())

        # 3. DAPO-style dynamic filtering of groups with no reward variance
        keep = torch.ones(len(items), dtype=torch.bool)
        if cfg.dynamic_filtering:
            keep = grouped.max(-1).values > grouped.min(-1).values
            metrics["rollout/filtered_groups"] = float((~keep).sum())
        keep_samples = [i for i in range(len(gens)) if bool(keep[i // n])]
        samples_log = [
            {"prompt": sample_items[i].prompt, "response": texts[i], "label": sample_items[i].label, "reward": float(rewards[i])}
            for i in range(min(len(gens), 4))
        ]
        if not keep_samples:
            metrics["time/generate"] = timings["generate"]
            return ExperienceBatch([], [], [], [], torch.zeros(0), [], metrics, samples_log)
        gens = [gens[i] for i in keep_samples]
        sample_items = [sample_items[i] for i in keep_samples]
        responses = [responses[i] for i in keep_samples]
        rewards = rewards[keep_samples]

        # 4. old-policy log-probs and entropy (at the sampling temperature)
        t0 = time.perf_counter()
        sequences = [list(it.prompt_ids) + r for it, r in zip(sample_items, responses)]
        prompt_lens = [len(it.prompt_ids) for it in sample_items]
        lp = self.actor.compute_logprobs_and_entropy(
            {"sequences": sequences, "prompt_lens": prompt_lens, "temperature": cfg.temperature}
        )
        old_log_probs, entropies = lp["log_probs"], lp["entropy"]
        timings["logprobs"] = time.perf_counter() - t0
        for i, (a, b, r) in enumerate(zip(old_log_probs, entropies, responses)):
            if a.numel() != len(r) or b.numel() != len(r):
                raise RuntimeError(f"actor returned {a.numel()} log-probs for a response of {len(r)} tokens (sample {i})")
        width = max(len(r) for r in responses)
        ent, mask = _pad(entropies, width)
        metrics["actor/old_entropy/mean"] = float(ent[mask].mean())

        # 5-7. segmentation, probes, advantages
        boundaries = potentials = None
        if shape.estimator != "grpo":
            t0 = time.perf_counter()
            ids_pad = None
            if self._delims is not None:
                ids_pad = torch.zeros(len(responses), width, dtype=torch.long)
                for i, r in enumerate(responses):
                    ids_pad[i, : len(r)] = torch.tensor(r)
            boundaries = segment_batch(ent, mask, shape, token_ids=ids_pad, delimiter_token_ids=self._delims)
            timings["segment"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            pot = estimate_potentials(
                self.engines,
                [list(it.prompt_ids) for it in sample_items],
                responses,
                boundaries_as_lists(boundaries),
                [it.label for it in sample_items],
                [float(x) for x in rewards],
                self.reward,
                self.probe_cfg,
                suffixes=self.suffixes,
            )
            timings["probes"] = time.perf_counter() - t0
            potentials = pad_potentials(pot.potentials, shape.num_segments)
            st = pot.stats
            metrics["probe/requests"] = st.get("probe_requests", 0.0)
            metrics["probe/tokens"] = st.get("probe_decode_tokens", 0.0)
            metrics["probe/prompt_tokens"] = st.get("probe_prompt_tokens", 0.0)
            metrics["probe/cached_tokens"] = st.get("probe_cached_tokens", 0.0)
            metrics["probe/prefix_hit_rate"] = st.get("probe_prefix_hit_rate", 0.0)
            metrics["probe/rounds"] = st.get("probe_rounds", 1.0)
            metrics["probe/samples_per_state"] = st.get("probe_samples_per_state", float(shape.num_probes))
            metrics["probe/tokens_saved"] = st.get("probe_tokens_saved", 0.0)
            metrics["probe/score_seconds"] = st.get("probe_score_time_s", 0.0)
            metrics["probe/unique_answers"] = st.get("probe_unique_answers", 0.0)
            metrics["probe/prefill_per_response_token"] = st.get("probe_computed_prompt_tokens", 0.0) / max(
                float(sum(len(r) for r in responses)), 1.0
            )
        t0 = time.perf_counter()
        res = compute_token_advantages(
            shape,
            mask,
            rewards,
            n,  # filtering drops whole groups, so groups still hold n samples
            max_response_len=cfg.max_new_tokens,
            entropy=ent,
            boundaries=boundaries,
            potentials=potentials,
        )
        timings["advantages"] = time.perf_counter() - t0
        metrics.update(res.metrics)
        adv = [res.token_advantages[i, : len(r)].clone() for i, r in enumerate(responses)]
        metrics["adv/token/mean"] = float(res.token_advantages[mask].mean())
        for k, v in timings.items():
            metrics[f"time/{k}"] = v
        return ExperienceBatch(
            sequences=sequences,
            prompt_lens=prompt_lens,
            old_log_probs=[x.float() for x in old_log_probs],
            advantages=adv,
            rewards=rewards,
            prompt_indices=[it.index for it in sample_items],
            metrics=metrics,
            samples=samples_log,
        )


class HFActor:
    """A plain Hugging Face forward as the log-prob/entropy actor (tools and light tests).

    Same contract as the Megatron worker's ``compute_logprobs_and_entropy`` at world size 1.
    """

    def __init__(self, model_dir: str, chunk_size: int = 256):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.chunk_size = chunk_size

    @torch.no_grad()
    def compute_logprobs_and_entropy(self, batch: dict) -> dict:
        temperature = float(batch.get("temperature", 1.0))
        log_probs, entropy = [], []
        for seq, plen in zip(batch["sequences"], batch["prompt_lens"]):
            ids = torch.tensor(seq)[None]
            logits = self.model(ids).logits[0, plen - 1 : len(seq) - 1]
            lp, ent = token_log_probs_and_entropy(logits, ids[0, plen:], temperature, self.chunk_size)
            log_probs.append(lp)
            entropy.append(ent)
        return {"log_probs": log_probs, "entropy": entropy}
