"""KL to the reference policy, with OpenRLHF 0.11's semantics: the estimators k1 / k2 / k3, the penalty in
the reward (the default) or in the loss (``--algo.kl.use_loss``), and the fixed or adaptive coefficient.

Notation: per sampled token, ``log_probs`` = log pi(y_t) of the policy the penalty applies to and
``ref_log_probs`` = log pi_ref(y_t) of the reference (the initial weights), both ``[B, T]`` (nats),
``r_t = log_probs - ref_log_probs``. Over samples of pi, each estimator's mean is an estimate of
KL(pi || pi_ref) (Schulman's k1 / k2 / k3):

* ``k1 = r``                      unbiased, can be negative per token
* ``k2 = r^2 / 2``                non-negative, biased
* ``k3 = exp(-r) - 1 + r``        non-negative, unbiased

Clamping, as OpenRLHF does it: k3 is evaluated with ``r`` clamped at -10 first (exp(10) bounds the value and
its derivative), and every estimate is clamped to ``[-10, 10]``.

In the reward (``--algo.kl.use_loss`` off): token t gets the reward ``-coef * kl_t`` besides the outcome
(:func:`kl_token_rewards`), computed from the old (rollout) policy's log-probs once per step. The outcome
estimators (GRPO, REINFORCE++, ...) take these rewards into their returns before any discount and whitening, as
OpenRLHF; SHAPE/MRT add the undiscounted KL still to come, ``-coef * sum_{s >= t} kl_s``
(:func:`kl_penalty_returns`), to each token's advantage.

In the loss (``--algo.kl.use_loss``): the actor adds ``coef * sum_t kl_t / N`` to the policy loss, kl at the
policy being trained and N the mini-batch's global valid-token count, the same token mean as the policy
loss (:func:`kl_loss_sum` gives the numerator).

The coefficient (:class:`KLController`): fixed at ``--algo.kl.init_coef``, or, with ``--algo.kl.target``, the
adaptive controller of Ziegler et al. (2019) that OpenRLHF ships: after each step
``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon`` (n = samples of the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CLAMP = 10.0  # every estimate lies in [-KL_CLAMP, KL_CLAMP]; k3's log-ratio is clamped at -KL_CLAMP first
IS_WEIGHT_CLIP = 10.0  # unbiased_gradient: the importance weight pi / pi_old is capped here (OpenRLHF's value)
ADAPTIVE_ERROR_CLIP = 0.2  # the adaptive controller's proportional error is clipped to +-0.2


def check_estimator(name: str) -> str:
    """``name`` if it is one of :data:`KL_ESTIMATORS`, else a ``ValueError`` naming the flag."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"--algo.kl.estimator: unknown estimator {name!r}; choose one of {KL_ESTIMATORS}")
    return name


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1", *,
              old_log_probs: torch.Tensor | None = None, unbiased_gradient: bool = False) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (float32) of ``log_probs`` against ``ref_log_probs`` (both ``[B, T]``).

    ``unbiased_gradient`` (``--algo.kl.unbiased_gradient``, for the KL in the loss): the value stays the
    estimator's, the gradient becomes ``w * r * grad log pi`` (the reverse-KL gradient from samples of the
    old policy), w = pi / pi_old detached and capped at :data:`IS_WEIGHT_CLIP` (w = 1 without ``old_log_probs``).
    Padding positions carry whatever their inputs give: mask them.
    """
    check_estimator(estimator)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs and ref_log_probs must share one shape, got {tuple(log_probs.shape)} and "
                         f"{tuple(ref_log_probs.shape)}")
    r = log_probs.float() - ref_log_probs.float()
    if estimator == "k1":
        value = r
    elif estimator == "k2":
        value = r.square() / 2
    else:
        rc = r.clamp(min=-KL_CLAMP)  # exp(-r) for r < -10 would overflow the value and its derivative
        value = torch.exp(-rc) - 1 + rc
    value = value.clamp(-KL_CLAMP, KL_CLAMP)
    if not unbiased_gradient:
        return value
    w = 1.0 if old_log_probs is None else (
        (log_probs.float() - old_log_probs.float()).exp().clamp(max=IS_WEIGHT_CLIP).detach())
    surrogate = w * r.square() / 2  # d/dtheta = w * r * grad log pi
    return value.detach() + surrogate - surrogate.detach()


def masked_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's mean over its valid tokens (0 for a row without any)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp(min=1)


def kl_token_rewards(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The KL penalty as per-token rewards ``[B, T]``: ``-coef * kl_t`` where ``mask`` is True (the policy's own
    tokens), 0 elsewhere (padding, an agent's environment replies). ``coef <= 0`` gives zeros (OpenRLHF treats a
    negative coefficient as 0). The outcome estimators add these to their token rewards before the returns."""
    if kl.shape != mask.shape:
        raise ValueError(f"kl and mask must share one shape [B, T], got {tuple(kl.shape)} and {tuple(mask.shape)}")
    return torch.where(mask.bool(), -max(float(coef), 0.0) * kl.float(), torch.zeros_like(kl, dtype=torch.float32))


def kl_penalty_returns(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The per-token KL rewards (:func:`kl_token_rewards`) as each token's undiscounted return ``[B, T]``:
    ``-coef * sum_{s >= t} kl_s`` over the tokens ``mask`` keeps (0 elsewhere). SHAPE/MRT add it to their
    advantages; the outcome estimators fold the rewards into their own returns instead."""
    rewards = kl_token_rewards(kl, mask, coef)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)  # sum over s >= t
    return torch.where(mask.bool(), to_go, torch.zeros_like(to_go))


def kl_loss_sum(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str, *,
                old_log_probs: torch.Tensor | None = None, unbiased_gradient: bool = False) -> torch.Tensor:
    """Scalar: the KL estimate summed over valid tokens (with grad through ``log_probs``). The loss term is
    ``coef * kl_loss_sum / N`` with N the mini-batch's global valid-token count (the policy loss's denominator)."""
    kl = approx_kl(log_probs, ref_log_probs, estimator, old_log_probs=old_log_probs,
                   unbiased_gradient=unbiased_gradient)
    return torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum()


@dataclass
class KLController:
    """The KL coefficient of a run: fixed (``target`` None) or adaptive towards ``target`` (nats per token,
    measured as the step's ``kl`` metric) over ``horizon`` samples. ``value`` is what the next step uses;
    checkpoints save it (:meth:`state_dict`) so that a resumed adaptive run continues exactly."""

    value: float
    target: float | None = None
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError(f"--algo.kl.init_coef must be >= 0, got {self.value}")
        if self.target is not None and self.target <= 0:
            raise ValueError(f"--algo.kl.target must be > 0 (or unset for a fixed coefficient), got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"--algo.kl.horizon must be >= 1, got {self.horizon}")

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current: float, n_steps: int) -> None:
        """After a step whose ``kl`` metric was ``current`` over ``n_steps`` samples (adaptive only)."""
        if self.target is None:
            return
        error = min(max(current / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class KLPenalty:
    """What a run does with the KL to its reference model (``--algo.kl.*``): the ``estimator``, whether it goes
    into the loss (``in_loss``) or into the reward, and the loss's ``unbiased_gradient``. The coefficient is not
    here: the trainer owns its :class:`KLController` and hands each batch the value it applies."""

    estimator: str = "k1"
    in_loss: bool = False
    unbiased_gradient: bool = False

    def __post_init__(self) -> None:
        check_estimator(self.estimator)
        if self.unbiased_gradient and not self.in_loss:
            raise ValueError("--algo.kl.unbiased_gradient changes only the gradient of the KL in the loss; add "
                             "--algo.kl.use_loss or drop it")
