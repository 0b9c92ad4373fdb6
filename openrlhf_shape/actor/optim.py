"""What both actor backends train with: Adam(W), the LR schedule, gradient clipping, the policy loss's
clip range, micro-batching and the seed, validated at construction.

The field names are the flag names: :class:`OptimSettings` is the ``--actor.*`` part a user sets
(the flag tree's ``actor`` section extends it, so ``--actor.adam.lr`` sets ``cfg.actor.adam.lr``, which is
``OptimConfig.adam.lr`` on the ranks); :class:`OptimConfig` adds what the run decides from ``--train.*``
(the schedule's length, the micro-batch token budget, the seed). The Megatron backend
(``MegatronConfig.optim``) and the DeepSpeed backend (``ZeroConfig.optim``) read the same object.

Defaults are OpenRLHF 0.11.2's (``--actor.*``: AdamW betas (0.9, 0.95), ``cosine_with_min_lr`` to 0.1 x the peak after
3% warm-up, PPO clip 0.2 on both sides); the paper's settings (``constant_with_warmup`` over 10% of the run, betas
(0.9, 0.999), clip-higher 0.2/0.28) are written out in the presets (configs/*.yaml). The schedules are transformers'
(:mod:`openrlhf_shape.actor.lr_schedule`).

Units: learning rates are absolute (``min_lr_ratio`` is a fraction of ``adam.lr``); steps count
optimizer steps; ``micro_batch_max_tokens`` (training) and ``forward_max_tokens`` (forward only) count
prompt+response tokens of one micro-batch on one data-parallel rank; ``entropy_chunk_size`` counts tokens per chunk of the log-prob/entropy computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_shape.actor.lr_schedule import SCHEDULES

POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo")  # = algorithms/loss.py LOSS_TYPES (this module stays torch-free)


def _int_at_least_one(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer >= 1, got {value!r}")


@dataclass
class AdamConfig:
    """Adam(W) with decoupled weight decay (no decay on biases and norm weights), as both backends run it."""

    lr: float = 1e-6  # the peak learning rate (after warmup)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not self.lr > 0:
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{name}.betas must be in [0, 1), got {tuple(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"{name}.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"{name}.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass
class OptimSettings:
    """The ``--actor.*`` training settings both backends share (a field's name is its flag under ``actor.``)."""

    adam: AdamConfig = field(default_factory=AdamConfig)
    lr_scheduler: str = "cosine_with_min_lr"  # transformers' schedule of this name (actor/lr_schedule.py: SCHEDULES)
    lr_warmup_ratio: float = 0.03  # warm-up over ceil(ratio x the run's optimizer steps), OpenRLHF's count
    lr_warmup_steps: Optional[int] = None  # ours: the warm-up count itself, wins over lr_warmup_ratio
    min_lr: Optional[float] = None  # ours: the *_with_min_lr floor, absolute; wins over min_lr_ratio
    min_lr_ratio: Optional[float] = 0.1  # the *_with_min_lr floor = ratio x adam.lr (None: 0)
    max_norm: float = 1.0  # gradient clipping by the global L2 norm (0 off)
    eps_clip: float = 0.2  # PPO ratio clip [1 - eps, 1 + eps] when eps_clip_low_high is unset (OpenRLHF's rule)
    eps_clip_low_high: Optional[tuple[float, float]] = None  # [1 - low, 1 + high] (DAPO clip-higher: 0.2 0.28)
    dual_clip: Optional[float] = None  # dual-clip PPO's bound on negative-advantage ratios (> 1), None off
    # the policy loss (algorithms/loss.py): ppo (token clip), gspo (sequence clip, OpenRLHF's), cispo (MiniMax-M1's)
    policy_loss_type: str = "ppo"
    # cispo: its importance weight is clipped to [1 - low, 1 + high]; low >= 1 leaves no lower bound (the paper's
    # choice); weight <= 4 as ScaleRL's recipe. --actor.eps_clip_low_high is ppo's and gspo's ratio clip.
    cispo_eps_clip_low_high: tuple[float, float] = (1.0, 3.0)
    entropy_chunk_size: int = 1024  # tokens per chunk of the log-prob / entropy computation
    gradient_checkpointing_enable: bool = False  # activation recompute in the backward pass
    # concatenate a micro-batch's samples into one row without padding (actor/batching.py, docs/packing.md); on by
    # default (OpenRLHF's --ds.packing_samples is accepted as always on); false: the padded layout (the parity tests'
    # reference; on a GPU without a varlen kernel packing can cost step time: docs/gpu_results.md)
    pack_samples: bool = True

    def __post_init__(self) -> None:
        self._check_schedule()
        self._check_loss()

    def _check_schedule(self) -> None:
        name = type(self).__name__
        schedule = SCHEDULES.get(self.lr_scheduler)
        if schedule is None:
            raise ValueError(f"{name}.lr_scheduler must be one of {', '.join(SCHEDULES)} (transformers' schedules, "
                             f"as OpenRLHF builds them), got {self.lr_scheduler!r}")
        if not 0.0 <= self.lr_warmup_ratio < 1.0:
            raise ValueError(f"{name}.lr_warmup_ratio must be in [0, 1), got {self.lr_warmup_ratio}")
        if self.lr_warmup_steps is not None and self.lr_warmup_steps < 0:
            raise ValueError(f"{name}.lr_warmup_steps must be >= 0 (or None), got {self.lr_warmup_steps}")
        if self.min_lr_ratio is not None and not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{name}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.adam.lr:
            raise ValueError(f"{name}.min_lr must be in [0, adam.lr={self.adam.lr}], got {self.min_lr}")
        # our own two knobs, refused where the schedule would not read them (OpenRLHF's ratios: unread, as there)
        if self.min_lr and not schedule.has_floor:
            raise ValueError(f"{name}.min_lr {self.min_lr}: {self.lr_scheduler} has no floor (linear and cosine decay "
                             "to 0); use lr_scheduler cosine_with_min_lr, or drop min_lr")
        if self.lr_warmup_steps and not schedule.warms_up:
            raise ValueError(f"{name}.lr_warmup_steps {self.lr_warmup_steps}: constant never warms up (transformers'); "
                             "use lr_scheduler constant_with_warmup")
        if self.max_norm < 0:
            raise ValueError(f"{name}.max_norm must be >= 0 (0 disables), got {self.max_norm}")

    def _check_loss(self) -> None:
        name = type(self).__name__
        if not 0 <= self.eps_clip < 1:
            raise ValueError(f"{name}.eps_clip must be in [0, 1), got {self.eps_clip}")
        if self.eps_clip_low_high is not None:
            low, high = self.eps_clip_low_high
            if not 0 <= low < 1 or high < 0:
                raise ValueError(f"{name}.eps_clip_low_high must be in [0, 1) and >= 0, got {tuple(self.eps_clip_low_high)}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"{name}.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.policy_loss_type not in POLICY_LOSS_TYPES:
            raise ValueError(f"{name}.policy_loss_type must be one of {POLICY_LOSS_TYPES}, got {self.policy_loss_type!r}")
        if self.policy_loss_type == "cispo" and self.dual_clip is not None:
            raise ValueError(f"{name}.dual_clip bounds PPO's clipped surrogate, which cispo has not: drop it")
        if min(self.cispo_eps_clip_low_high) < 0:
            raise ValueError(f"{name}.cispo_eps_clip_low_high must be >= 0, got {tuple(self.cispo_eps_clip_low_high)}")
        _int_at_least_one(self, "entropy_chunk_size")

    @property
    def policy_clip_low_high(self) -> tuple[float, float]:
        """The clip of the policy loss in use: cispo's weight clip, else the PPO/GSPO ratio clip."""
        return tuple(self.cispo_eps_clip_low_high if self.policy_loss_type == "cispo" else self.eps_clip_low_high)

    @property
    def min_lr_rate(self) -> float:
        """The floor of the ``*_with_min_lr`` schedules over ``adam.lr``: ``min_lr / adam.lr`` when ``min_lr`` is set
        (transformers' ``min_lr`` argument), else ``min_lr_ratio`` (OpenRLHF's ``min_lr_rate``)."""
        if self.min_lr is not None:
            return self.min_lr / self.adam.lr
        return self.min_lr_ratio or 0.0

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(low, high) of the PPO ratio clip: ``eps_clip_low_high`` when set, else ``eps_clip`` on both sides."""
        if self.eps_clip_low_high is not None:
            return (float(self.eps_clip_low_high[0]), float(self.eps_clip_low_high[1]))
        return (float(self.eps_clip), float(self.eps_clip))


@dataclass
class OptimConfig(OptimSettings):
    """What a rank trains with: the ``--actor.*`` settings plus what the run decides.

    ``total_steps``: optimizer steps of the whole run (the schedule's length; the trainer derives it
    from ``--train.num_steps``, the batch sizes and ``--train.max_epochs``). ``micro_batch_max_tokens``:
    ``--train.max_tokens_per_gpu`` (a training micro-batch). ``forward_max_tokens``: ``--rollout.max_tokens_per_gpu``
    (a forward-only micro-batch: old log-probs and entropy; None: ``micro_batch_max_tokens``). ``seed``: ``--train.seed``.
    On a rank ``eps_clip_low_high`` is always the resolved pair (:attr:`clip_bounds`), whatever the flags gave.
    """

    total_steps: int = 1000
    micro_batch_max_tokens: int = 8192
    forward_max_tokens: Optional[int] = None
    seed: int = 42

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least_one(self, "total_steps")
        _int_at_least_one(self, "micro_batch_max_tokens")
        if self.forward_max_tokens is not None:
            _int_at_least_one(self, "forward_max_tokens")
        if self.lr_warmup_steps is not None and self.lr_warmup_steps >= self.total_steps:
            raise ValueError(f"OptimConfig.lr_warmup_steps must be in [0, total_steps={self.total_steps}), "
                             f"got {self.lr_warmup_steps}")
        self.eps_clip_low_high = self.clip_bounds  # the losses of both backends read the pair

    @property
    def forward_budget(self) -> int:
        """Tokens (prompt + response, padded) of one forward-only micro-batch on one data-parallel rank."""
        return self.forward_max_tokens if self.forward_max_tokens is not None else self.micro_batch_max_tokens

    @property
    def warmup_steps(self) -> int:
        """Optimizer steps of linear warm-up: ``lr_warmup_steps``, else ``ceil(total_steps x lr_warmup_ratio)``
        (OpenRLHF's count; ``constant`` does not read it)."""
        if self.lr_warmup_steps is not None:
            return self.lr_warmup_steps
        return math.ceil(self.total_steps * self.lr_warmup_ratio)
