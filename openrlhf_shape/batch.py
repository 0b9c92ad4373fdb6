"""Typed batches between the experience maker and the actor (the policy loss), and what the actor returns.

:class:`SequenceBatch` goes into a forward, :class:`LogProbs` comes back from it, :class:`ExperienceBatch`
is one step's experiences (filled phase by phase), :class:`TrainBatch` goes into an optimizer step.

Rows are samples in prompt-major order (the n samples of one prompt are contiguous). Token ids stay
ragged (``list[list[int]]``) because the actor re-packs them into micro-batches by a token budget;
every per-token float travels as a right-padded ``[B, T]`` tensor, T = the longest response, where
response token j of row i sits at column j (``sequences[i][prompt_lens[i] + j]``). Padding is 0
(False for masks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


def pad_rows(rows: Sequence[torch.Tensor], width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stack 1-D tensors ``[T_i]`` into ``[B, width]`` (0-padded; width defaults to max T_i)."""
    width = max((int(r.numel()) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width, dtype=dtype)
    if rows:
        lengths = torch.tensor([int(r.numel()) for r in rows])
        mask = torch.arange(width)[None, :] < lengths[:, None]
        if int(lengths.sum()):
            out[mask] = torch.cat([r.reshape(-1).to(dtype) for r in rows])
    return out


def length_mask(lengths: Sequence[int] | torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True at the first ``lengths[i]`` columns of row i."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return torch.arange(width)[None, :] < lengths[:, None]


@dataclass(frozen=True)
class ActionColumns:
    """Where each row's policy tokens sit among its ``T`` response columns. The phases that credit tokens
    (segmentation, the probes' states, advantages, TCR) work on these columns only, so an agent's
    environment replies (``ExperienceBatch.action_mask``) never become a segment's tokens, a boundary or a
    probe prefix's last token inside a reply.

    ``positions`` ``[B, A]`` long: the response column of row i's j-th policy token (A = the most policy
    tokens of any row; 0 past row i's count); ``mask`` ``[B, A]`` bool, True at ``[:A_i]`` (right-padded,
    what segmentation expects); ``width``: T. With no environment replies ``positions[i, :T_i]`` is
    ``0..T_i-1`` and every map below is the identity.
    """

    positions: torch.Tensor
    mask: torch.Tensor
    width: int

    @classmethod
    def of(cls, loss_mask: torch.Tensor) -> "ActionColumns":
        """From a ``[B, T]`` bool mask of the policy's tokens."""
        loss_mask = loss_mask.bool()
        counts = loss_mask.sum(-1)
        mask = length_mask(counts, int(counts.max()) if counts.numel() else 0)
        positions = torch.zeros(mask.shape, dtype=torch.long)
        positions[mask] = loss_mask.nonzero(as_tuple=True)[1]  # row-major: a row's columns ascending
        return cls(positions, mask, int(loss_mask.shape[1]))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` -> ``[B, A]``: each row's values at its policy tokens, 0 (False) past them."""
        out = x.gather(1, self.positions)
        return torch.where(self.mask, out, torch.zeros_like(out))

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, A]`` -> ``[B, T]``: values back at their response columns; 0 at environment replies and padding."""
        out = values.new_zeros(values.shape[0], self.width)
        rows = torch.arange(values.shape[0])[:, None].expand_as(self.mask)
        out[rows[self.mask], self.positions[self.mask]] = values[self.mask]
        return out

    def to_response(self, boundaries: torch.Tensor) -> torch.Tensor:
        """Boundaries ``[B, K-1]`` counted in policy tokens (-1 padded) -> the same boundaries as response
        columns (-1 kept): the state at boundary b is prompt + response[:column of policy token b]."""
        if boundaries.numel() == 0:
            return boundaries.clone()
        cols = self.positions.gather(1, boundaries.clamp(min=0))
        return torch.where(boundaries >= 0, cols, boundaries)


@dataclass(kw_only=True)
class SequenceBatch:
    """Input of a forward pass: B prompt+response sequences and the sampling temperature.

    ``sequences``: B lists of token ids; ``prompt_lens``: B prompt lengths in tokens (>= 1);
    ``temperature``: log-probs and entropy are taken of ``logits / temperature``.
    ``routed_experts``: MoE routing replay (``megatron/routing_replay.py``, ``--megatron.routing_replay``):
    per sample an integer tensor ``[L_i, layers, top_k]``, the experts each token (prompt and response, in
    order; ``L_i`` = len(sequence) or one less) is routed to; None without replay.
    """

    sequences: list[list[int]]
    prompt_lens: list[int]
    temperature: float = 1.0
    routed_experts: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    @property
    def response_width(self) -> int:
        """T: the longest response in tokens (the width of the ``[B, T]`` tensors)."""
        return max(self.response_lens, default=0)

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, True at real response tokens."""
        return length_mask(self.response_lens, self.response_width)

    @classmethod
    def coerce(cls, batch: "SequenceBatch | dict[str, Any]") -> "SequenceBatch":
        """Accept a typed batch, or a mapping with sequences / prompt_lens / temperature (tests, tools)."""
        if isinstance(batch, SequenceBatch):
            return batch
        for key in ("sequences", "prompt_lens"):
            if key not in batch:
                raise KeyError(f"batch is missing {key!r}; expected keys sequences, prompt_lens, temperature")
        return SequenceBatch(sequences=batch["sequences"], prompt_lens=batch["prompt_lens"],
                             temperature=float(batch.get("temperature", 1.0)), routed_experts=batch.get("routed_experts"))

    def validate(self) -> None:
        """Check the shapes; errors name the field and the fix."""
        seqs, plens = self.sequences, self.prompt_lens
        if len(seqs) != len(plens):
            raise ValueError(f"batch.sequences has {len(seqs)} rows but batch.prompt_lens has {len(plens)}")
        if len(seqs) == 0:
            raise ValueError("batch.sequences is empty")
        for i, (s, p) in enumerate(zip(seqs, plens)):
            if not 1 <= p <= len(s):
                raise ValueError(
                    f"batch.prompt_lens[{i}]={p} must be in [1, len(sequences[{i}])={len(s)}] "
                    "(at least one prompt token; the response may be empty)"
                )
        if float(self.temperature) <= 0:
            raise ValueError(f"batch.temperature must be > 0, got {self.temperature}")
        if self.routed_experts is not None and len(self.routed_experts) != len(seqs):
            raise ValueError(f"batch.routed_experts has {len(self.routed_experts)} entries for {len(seqs)} sequences "
                             "(one [L_i, layers, top_k] tensor per sample)")


@dataclass(kw_only=True)
class ValueBatch(SequenceBatch):
    """Input of one critic update (``--algo.advantage.estimator gae``): a :class:`SequenceBatch` plus ``[B, T]``
    per-token tensors of the response's states: ``old_values`` float32, the critic's values when the batch was
    made; ``returns`` float32, GAE's targets; ``loss_mask`` bool, OpenRLHF's action mask (False at padding)."""

    old_values: torch.Tensor
    returns: torch.Tensor
    loss_mask: torch.Tensor

    def validate(self) -> None:
        super().validate()
        shape = (len(self), self.response_width)
        for name in ("old_values", "returns", "loss_mask"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != shape[0] or t.shape[1] < shape[1]:
                raise ValueError(f"batch.{name} must be [B, T] = [{shape[0]}, >= {shape[1]}], got {tuple(t.shape)}")


@dataclass(frozen=True)
class KLLossTerm:
    """The KL term of the policy loss (``--algo.kl.use_loss``, algorithms/kl.py): ``coef`` x the token mean of the
    ``estimator`` (k1 | k2 | k3) of the trained policy against the reference; ``unbiased_gradient``: its
    importance-weighted reverse-KL gradient. The coefficient is this step's (the adaptive controller moves it)."""

    coef: float
    estimator: str = "k1"
    unbiased_gradient: bool = False


@dataclass(kw_only=True)
class TrainBatch(SequenceBatch):
    """Input of one optimizer step: a :class:`SequenceBatch` plus ``[B, T]`` per-token tensors.

    ``old_log_probs``: float32 log-probs of the policy that sampled (at ``temperature``);
    ``advantages``: float32 per-token advantages; ``loss_mask``: bool, tokens that enter the loss
    (False at padding). With ``kl_loss`` (KL in the loss) ``ref_log_probs``: float32 log-probs of the
    reference model (the initial weights) at ``temperature``.
    """

    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    is_weights: torch.Tensor | None = None  # float32 rollout-correction weights (algorithms/rollout_correction.py)
    # float32 the engines' log-probs of the sampled tokens, with the correction on (gspo then takes its ratio
    # against them, as OpenRLHF's GSPO); None otherwise
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    kl_loss: KLLossTerm | None = None

    @classmethod
    def from_ragged(cls, sequences: list[list[int]], prompt_lens: list[int], old_log_probs: Sequence[torch.Tensor],
                    advantages: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor] | None = None,
                    temperature: float = 1.0) -> "TrainBatch":
        """Build from per-sample ``[T_i]`` tensors (tests and tools)."""
        seq = SequenceBatch(sequences=sequences, prompt_lens=prompt_lens, temperature=temperature)
        width = seq.response_width
        valid = seq.response_mask()
        mask = valid if loss_mask is None else pad_rows(loss_mask, width, torch.bool) & valid
        return cls(sequences=sequences, prompt_lens=prompt_lens, temperature=temperature,
                   old_log_probs=pad_rows(old_log_probs, width), advantages=pad_rows(advantages, width), loss_mask=mask)

    def validate(self) -> None:
        super().validate()
        shape = (len(self), self.response_width)
        if self.kl_loss is not None and self.ref_log_probs is None:
            raise ValueError("batch.kl_loss (--algo.kl.use_loss) needs batch.ref_log_probs, the reference model's log-probs")
        optional = tuple(n for n in ("is_weights", "rollout_log_probs", "ref_log_probs") if getattr(self, n) is not None)
        for name in ("old_log_probs", "advantages", "loss_mask") + optional:
            t = getattr(self, name)
            if tuple(t.shape[:1]) != shape[:1] or t.dim() != 2 or t.shape[1] < shape[1]:
                raise ValueError(f"batch.{name} must be [B, T] = [{shape[0]}, >= {shape[1]}], got {tuple(t.shape)}")


@dataclass(frozen=True)
class LogProbs:
    """Log-probs and entropy of a :class:`SequenceBatch`'s responses, per sample in batch order.

    ``log_probs`` / ``entropy``: B float32 tensors ``[T_i]`` (T_i = sample i's response length), the
    sampled tokens' log-probs and the full distribution's entropy (nats) at the batch's temperature.
    ``routed_experts``: MoE routing replay (``--megatron.routing_replay``): per sample ``[L_i, layers,
    top_k]`` the experts this pass routed each token to (recorded, R2, or replayed); None without replay.
    """

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    routed_experts: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.log_probs)

    def padded(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_probs, entropy)``, each float32 ``[B, width]`` (0-padded; width defaults to the longest)."""
        return pad_rows(self.log_probs, width), pad_rows(self.entropy, width)


@dataclass
class ExperienceBatch:
    """One step's experiences, filled phase by phase. B samples (prompt-major), T = longest response.

    ``items``: each sample's prompt item (prompt text and ids, label, dataset ``index``);
    ``sequences`` prompt + response ids; ``texts`` decoded responses; ``response_mask`` ``[B, T]``
    bool; ``rollout_log_probs`` ``[B, T]`` vLLM's sampled-token log-probs (when sampled with
    ``logprobs``); ``rewards`` / ``scores`` ``[B]``; ``old_log_probs`` / ``entropy`` /
    ``advantages`` ``[B, T]`` float32, 0 at padding; ``is_weights`` ``[B, T]`` the rollout-correction
    weights (None when the correction is off); ``ref_log_probs`` / ``kl`` ``[B, T]`` float32 the reference
    model's log-probs and the per-token KL estimate of the old policy against it (None without a reference model;
    ``kl`` is 0 at environment tokens: only the policy's own tokens are penalised).

    ``action_mask`` ``[B, T]`` bool (agents, ``--train.agent_func_path``): True at the tokens the policy
    sampled (its turns), False at the environment's replies between and after them, which the policy
    only reads; None when every response token is the policy's. Everything that credits or trains
    tokens reads :meth:`loss_mask` (the policy's tokens); the log-prob pass reads whole sequences.
    """

    items: list[Any]
    sequences: list[list[int]]
    prompt_lens: list[int]
    texts: list[str]
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    truncated: torch.Tensor | None = None  # [B] bool: the engine stopped the response at the token limit
    metrics: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few decoded samples for the log
    # MoE routing replay (--megatron.routing_replay): per sample [L_i, layers, top_k] expert ids, from the engine
    # (R3) or recorded by the old-log-prob pass (R2); handed to every train_batch
    routed_experts: list[torch.Tensor] | None = None
    # Updates held by the weights that generated the batch (the engines') and by those that computed its old
    # log-probs and entropy (the ranks'): equal in synchronous training; --train.async_enable reads the gap
    policy_version: int = 0
    logprob_version: int = 0
    action_mask: torch.Tensor | None = None
    # --train.partial_rollout_enable: [B, T] long, the updates held by the weights that sampled each response token
    # (-1 at padding); a response cut by weight syncs carries several. None: every token of a sample has
    # policy_version. policy_version is then the oldest of them.
    token_versions: torch.Tensor | None = None
    probe_version: int | None = None  # updates held by the engines when they ran the batch's probes (async runs)
    # the KL coefficient the batch applies, in its advantages (KL in the reward) and its loss (KL in the loss): the
    # controller's value read once, when its reference log-probs are computed (trainer/experience.py); None: no KL
    kl_coef: float | None = None
    # --shape.entropy_source engine: per sample, boundary -> (the first probe round's samples of the state prompt +
    # response[:boundary], drawn as the response finished, and whether rollout responses still decoded then);
    # boundary 0 (the prompt alone) at every sample of its prompt (rollout/tail.py). None: the probes phase draws them
    tail_probes: list[dict[int, Any]] | None = None
    # --algo.advantage.estimator gae: [B, T] float32 the critic's values of each response token's state when the batch
    # was made (its values phase) and GAE's returns, the critic's targets (its advantages phase); 0 at padding
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def loss_mask(self) -> torch.Tensor:
        """``[B, T]`` bool: the tokens the policy sampled (the response, less any environment replies)."""
        if self.action_mask is None:
            return self.response_mask
        if self.action_mask.shape != self.response_mask.shape:
            raise ValueError(f"action_mask {tuple(self.action_mask.shape)} must have response_mask's shape "
                             f"{tuple(self.response_mask.shape)}")
        return self.response_mask & self.action_mask.bool()

    def action_columns(self) -> "ActionColumns":
        """Where each row's policy tokens sit among its response tokens (the credit phases' view)."""
        return ActionColumns.of(self.loss_mask())

    @property
    def responses(self) -> list[list[int]]:
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lens)]

    def response_ids(self) -> torch.Tensor:
        """``[B, T]`` long response token ids (0-padded)."""
        return pad_rows([torch.tensor(r, dtype=torch.long) for r in self.responses], self.response_mask.shape[1],
                        torch.long)

    def select(self, rows: Sequence[int]) -> "ExperienceBatch":
        """The samples at ``rows`` (tensors indexed, lists picked); metrics and samples kept. With per-token
        versions, ``policy_version`` becomes the oldest version among the rows kept."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        take = lambda t: None if t is None else t[idx]  # noqa: E731
        kept = None if self.token_versions is None else self.token_versions[idx]
        version = int(kept[kept >= 0].min()) if kept is not None and bool((kept >= 0).any()) else self.policy_version
        return dataclasses.replace(
            self, items=pick(self.items), sequences=pick(self.sequences), prompt_lens=pick(self.prompt_lens),
            texts=pick(self.texts), response_mask=self.response_mask[idx], rollout_log_probs=take(self.rollout_log_probs),
            rewards=take(self.rewards), scores=take(self.scores), old_log_probs=take(self.old_log_probs),
            entropy=take(self.entropy), advantages=take(self.advantages), is_weights=take(self.is_weights),
            ref_log_probs=take(self.ref_log_probs), kl=take(self.kl), truncated=take(self.truncated),
            routed_experts=None if self.routed_experts is None else pick(self.routed_experts),
            action_mask=take(self.action_mask), token_versions=kept, policy_version=version,
            tail_probes=None if self.tail_probes is None else pick(self.tail_probes), values=take(self.values),
            returns=take(self.returns),
        )

    @classmethod
    def concat(cls, parts: Sequence["ExperienceBatch"]) -> "ExperienceBatch":
        """The samples of ``parts`` in order (dynamic filtering's refill rounds, trainer/experience.py): per-sample
        lists joined, ``[B]`` tensors concatenated, ``[B, T]`` ones right-padded to the widest T (0 / False; -1 for
        ``token_versions``); the first part's metrics and log samples, the oldest ``policy_version`` of the parts
        that hold samples."""
        first, width, joined = parts[0], max(p.response_mask.shape[1] for p in parts), {}
        for f in dataclasses.fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if f.name in ("metrics", "samples", "logprob_version", "probe_version"):
                continue  # the first part's (a batch is joined before its old log-probs and probes exist)
            if f.name == "policy_version":
                joined[f.name] = min((v for v, p in zip(vals, parts) if len(p)), default=first.policy_version)
            elif any(v is None for v in vals):
                if not all(v is None for v in vals):
                    raise ValueError(f"cannot join batches where only some carry {f.name}")
            elif isinstance(vals[0], list):
                joined[f.name] = [x for v in vals for x in v]
            elif vals[0].dim() == 1:
                joined[f.name] = torch.cat(vals)
            else:
                padded = [v.new_full((v.shape[0], width), -1 if f.name == "token_versions" else 0) for v in vals]
                for p, v in zip(padded, vals):
                    p[:, : v.shape[1]] = v
                joined[f.name] = torch.cat(padded)
        return dataclasses.replace(first, **joined)

    def sequence_batch(self, temperature: float) -> SequenceBatch:
        return SequenceBatch(sequences=self.sequences, prompt_lens=self.prompt_lens, temperature=temperature,
                             routed_experts=self.routed_experts)

    def value_batch(self, rows: Sequence[int], temperature: float) -> ValueBatch:
        """The critic's :class:`ValueBatch` for the samples at ``rows`` (one mini-batch, the actor's rows): the old
        values and GAE's returns of the policy's tokens (``--algo.advantage.estimator gae``)."""
        if self.values is None or self.returns is None:
            raise ValueError("a critic update needs the batch's values and returns (the maker's values and advantages "
                             "phases with --algo.advantage.estimator gae)")
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        width = max(int(self.response_mask[idx].sum(-1).max()), 0) if len(idx) else 0
        return ValueBatch(sequences=[self.sequences[i] for i in rows], prompt_lens=[self.prompt_lens[i] for i in rows],
                          temperature=temperature, old_values=self.values[idx, :width],
                          returns=self.returns[idx, :width], loss_mask=self.loss_mask()[idx, :width])

    def train_batch(self, rows: Sequence[int], temperature: float, kl_loss: KLLossTerm | None = None) -> TrainBatch:
        """The actor's :class:`TrainBatch` for the samples at ``rows`` (one mini-batch); with ``kl_loss`` (KL in the
        loss) it carries the reference log-probs."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        mask = self.loss_mask()[idx]  # environment replies (agents) enter no loss, nor the KL term
        width = max(int(self.response_mask[idx].sum(-1).max()), 0) if len(idx) else 0
        if kl_loss is not None and self.ref_log_probs is None:
            raise ValueError("a KL term in the loss needs the reference log-probs (the maker's ref_logprobs phase)")
        return TrainBatch(
            ref_log_probs=None if kl_loss is None else self.ref_log_probs[idx, :width], kl_loss=kl_loss,
            sequences=[self.sequences[i] for i in rows], prompt_lens=[self.prompt_lens[i] for i in rows],
            temperature=temperature, old_log_probs=self.old_log_probs[idx, :width],
            advantages=self.advantages[idx, :width], loss_mask=mask[:, :width],
            is_weights=None if self.is_weights is None else self.is_weights[idx, :width],
            rollout_log_probs=None if self.is_weights is None else self.rollout_log_probs[idx, :width],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in rows],
        )
