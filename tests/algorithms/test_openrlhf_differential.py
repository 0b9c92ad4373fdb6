"""Differential tests: for what a flag that docs/openrlhf_compat.md marks the same does, OpenRLHF 0.11.2's own
installed function (run from its source where its module cannot be imported on CPU: tests/algorithms/
openrlhf_source.py) and ours on the same seeded random inputs, several shapes and the edge cases (one token, a
fully masked row, log-ratios past the clamp, junk in the padding).

* the policy loss and its aggregation (``--actor.eps_clip_low_high``, ``--actor.dual_clip``,
  ``--actor.policy_loss_type ppo|gspo``): OpenRLHF's ``PolicyLoss`` / ``aggregate_loss``, loss, gradient and the
  clip fraction, whole and split into micro-batches over the global counts;
* TIS / ICEPOP / sequence-mask TIS and the divergence gates (``--algo.advantage.is_correction_*``): ``PolicyLoss``
  with its correction against our weights times our loss; GSPO with the correction (our micro-batch loss, which
  takes the engines' log-probs then);
* the KL estimators (``--algo.kl.estimator``, ``--algo.kl.unbiased_gradient``): ``compute_approx_kl``, value and
  gradient; the KL in the reward (``--algo.kl.init_coef``): ``compute_reward``; the adaptive controller
  (``--algo.kl.target``, ``--algo.kl.horizon``): ``AdaptiveKLController``;
* the step's per-update metrics (the ``kl`` the controller reads): ``ppo_train``'s ``status_mean``;
* the stop-properly penalty (``--reward.stop_properly_penalty_coef``): ``apply_length_penalties`` (the overlong
  penalty, ``--reward.overlong_buffer_len``, is refused here: nothing to compare);
* the dynamic filter's keep rule (``--algo.dynamic_filtering_range``): ``SamplesGenerator._generate_vllm``'s test.

Advantages and returns (``--algo.advantage.*``, with the KL in the reward) have theirs beside their own tests:
tests/algorithms/test_reinforce_estimators.py, tests/trainer/test_kl_in_reward.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch
from openrlhf_shape.actor.micro_batch_loss import micro_batch_loss
from openrlhf_shape.algorithms.kl import KLController, approx_kl, kl_token_rewards
from openrlhf_shape.algorithms.loss import policy_loss
from openrlhf_shape.algorithms.returns import outcome_token_rewards
from openrlhf_shape.algorithms.rollout_correction import (RolloutCorrectionConfig, rollout_correction_weights,
                                                          rollout_mismatch_metrics)
from openrlhf_shape.batch import TrainBatch

SHAPES = [(1, 1), (3, 7), (8, 33)]


@pytest.fixture(scope="module")
def theirs():
    from openrlhf_source import load_loss_module

    return load_loss_module()


def _batch(seed: int, b: int, t: int, spread: float = 0.3, empty_row: bool = False):
    """Log-probs ``[b, t]``: old in (-3, 0), new = old + spread x N(0, 1), rollout = old + 0.4 x N(0, 1); advantages
    N(0, 1); ragged lengths 1..t (row 1 fully masked with ``empty_row``); finite junk at the padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if empty_row and b > 1:
        mask[1] = False
    old = -torch.rand(b, t, generator=g) * 3
    new = old + spread * torch.randn(b, t, generator=g)
    rollout = old + 0.4 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    junk = torch.randn(b, t, generator=g) * 5
    return [torch.where(mask, x, junk) for x in (new, old, rollout, adv)] + [mask]


def _both(ours_fn, theirs_fn, new: torch.Tensor):
    """(loss, gradient) of each on its own leaf copy of ``new``."""
    out = []
    for fn in (ours_fn, theirs_fn):
        leaf = new.clone().requires_grad_()
        loss = fn(leaf)
        loss.backward()
        out.append((loss.detach(), leaf.grad))
    return out


def _close(ours, theirs, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(ours[0], theirs[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(ours[1], theirs[1], rtol=rtol, atol=atol)


# ---- the policy loss -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.35), (3e-4, 4e-4)])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("spread", [0.3, 30.0])
def test_policy_loss_equals_openrlhfs(theirs, shape, clip, dual_clip, loss_type, spread):
    """Loss, gradient and clip fraction (our pg_clipfrac = its ppo_clip_ratio); spread 30: log-ratios past the +-20
    clamp (PPO's per token: both clamp; GSPO's sequence mean: ours clamps, OpenRLHF does not, so only rows whose
    mean stays inside are compared there)."""
    for seed in range(3):
        new, old, _, adv, mask = _batch(seed, *shape, spread=spread, empty_row=seed == 1)
        if loss_type == "gspo" and spread > 1:  # keep the sequences whose mean log-ratio stays within the clamp
            seq = ((new - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            mask = mask & (seq.abs() < 19)[:, None]
        n_tok, n_seq = mask.sum().float(), mask.any(-1).sum().float()
        if not mask.any():  # nothing to train on: ours 0 with no gradient (OpenRLHF divides 0 by 0)
            assert policy_loss(new, old, adv, mask, loss_type=loss_type, num_global_samples=0)[0].item() == 0.0
            continue
        fn = theirs["PolicyLoss"](clip_eps_low=clip[0], clip_eps_high=clip[1], dual_clip=dual_clip,
                                  policy_loss_type=loss_type)
        o, t = _both(lambda lp: policy_loss(lp, old, adv, mask, clip[0], clip[1], dual_clip, n_tok,
                                            loss_type=loss_type, num_global_samples=n_seq)[0],
                     lambda lp: fn(lp, old, adv, action_mask=mask.float(), batch_num_tokens=n_tok,
                                   global_batch_size=n_seq)[0], new)
        _close(o, t, rtol=1e-5, atol=1e-5 if spread > 1 else 1e-6)
        _, m = policy_loss(new, old, adv, mask, clip[0], clip[1], dual_clip, loss_type=loss_type)
        clip_ratio = fn(new, old, adv, action_mask=mask.float())[1]
        ours = (m["clipfrac_low_sum"] + m["clipfrac_high_sum"]) / m["num_tokens"]
        assert ours.item() == pytest.approx(clip_ratio.item(), abs=1e-6)


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_aggregation_over_micro_batches_equals_openrlhfs(theirs, loss_type):
    """The mini-batch split into micro-batches, each normalised by the global token / sample count (our backends'
    way, OpenRLHF's ``batch_num_tokens`` / ``global_batch_size``): the parts sum to the whole on both sides."""
    new, old, _, adv, mask = _batch(5, 8, 17, empty_row=True)
    n_tok, n_seq = mask.sum().float(), mask.any(-1).sum().float()
    fn = theirs["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.28, policy_loss_type=loss_type)
    ours = theirs_sum = 0.0
    for rows in ([0, 3], [1], [2, 4, 5, 6, 7]):
        r = torch.tensor(rows)
        ours += policy_loss(new[r], old[r], adv[r], mask[r], 0.2, 0.28, None, n_tok, loss_type=loss_type,
                            num_global_samples=n_seq)[0]
        theirs_sum += fn(new[r], old[r], adv[r], action_mask=mask[r].float(), batch_num_tokens=n_tok,
                         global_batch_size=n_seq)[0]
    whole = fn(new, old, adv, action_mask=mask.float())[0]  # its own counts: the mean over the whole
    assert float(ours) == pytest.approx(float(theirs_sum), rel=1e-6) and float(ours) == pytest.approx(float(whole),
                                                                                                        rel=1e-5)


# ---- TIS / ICEPOP / sequence mask -------------------------------------------------------------------------------

CORRECTIONS = [("token", "clip", "ratio", (0.5, 5.0)),  # TIS
               ("token", "mask", "ratio", (0.5, 5.0)),  # ICEPOP
               ("seq", "mask", "ratio", (0.8, 1.25)),  # sequence-mask TIS
               ("token", "mask", "ratio", (0.8, 1.25)),
               ("token", "mask", "binary_kl", (0.0, 0.05)),
               ("token", "mask", "tv", (0.0, 0.1)),
               ("seq", "mask", "binary_kl", (0.0, 0.02)),
               ("seq", "mask", "tv", (0.0, 0.1))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level, mode, gating, band", CORRECTIONS)
def test_rollout_correction_equals_openrlhfs(theirs, shape, level, mode, gating, band):
    """Our weights (``rollout_correction_weights``) times our PPO loss against OpenRLHF's ``PolicyLoss`` with the
    correction: loss, gradient, the filtered share (its ``is_filter_ratio``) and its ``vllm_kl``."""
    cfg = RolloutCorrectionConfig(level, mode, gating, band)
    for seed in range(3):
        new, old, rollout, adv, mask = _batch(seed, *shape)
        n_tok = mask.sum().float()
        w, wm = rollout_correction_weights(old, rollout, mask, cfg)
        fn = theirs["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level=level,
                                  is_correction_mode=mode, is_correction_gating=gating, is_correction_threshold=band)
        o, t = _both(lambda lp: policy_loss(lp, old, adv, mask, 0.2, 0.28, None, n_tok, is_weights=w)[0],
                     lambda lp: fn(lp, old, adv, action_mask=mask.float(), rollout_log_probs=rollout,
                                   batch_num_tokens=n_tok)[0], new)
        _close(o, t)
        _, _, _, vllm_kl, filtered = fn(new, old, adv, action_mask=mask.float(), rollout_log_probs=rollout)
        assert wm["filtered_frac"] == pytest.approx(float(filtered), abs=1e-6)
        assert rollout_mismatch_metrics(old, rollout, mask)["kl"] == pytest.approx(float(vllm_kl), abs=1e-6)


def test_gspo_with_the_correction_takes_the_engines_log_probs_as_openrlhf(theirs):
    """``--actor.policy_loss_type gspo`` with ``--algo.advantage.is_correction_level token``: OpenRLHF's GSPO takes its
    sequence ratio against the rollout log-probs and applies no weights; our micro-batch loss (both backends') does
    the same from the TrainBatch (two micro-batches over the global sample count)."""
    new, old, rollout, adv, mask = _batch(3, 4, 6)
    seqs = [[7] * 2 + [9] * int(n) for n in mask.sum(-1)]
    batch = TrainBatch(sequences=seqs, prompt_lens=[2] * 4, old_log_probs=old, advantages=adv, loss_mask=mask,
                       rollout_log_probs=rollout,
                       is_weights=rollout_correction_weights(old, rollout, mask, RolloutCorrectionConfig("token"))[0])
    total, grads = 0.0, torch.zeros_like(new)
    for rows in ([0, 2], [1, 3]):
        mb = build_micro_batch(seqs, [2] * 4, rows)
        lp = torch.cat([new[r][mask[r]] for r in rows]).requires_grad_()
        loss, _ = micro_batch_loss(lp, torch.zeros_like(lp), mb, batch, mask, int(mask.sum()), eps_low=0.2,
                                   eps_high=0.28, dual_clip=None, loss_type="gspo", num_global_samples=4)
        loss.backward()
        total += float(loss)
        grads[torch.tensor(rows)] = torch.zeros(len(rows), mask.shape[1]).masked_scatter(mask[rows], lp.grad)
    fn = theirs["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.28, policy_loss_type="gspo",
                              is_correction_level="token")
    leaf = new.clone().requires_grad_()
    theirs_loss = fn(leaf, old, adv, action_mask=mask.float(), rollout_log_probs=rollout)[0]
    theirs_loss.backward()
    assert total == pytest.approx(float(theirs_loss), rel=1e-6)
    torch.testing.assert_close(grads, leaf.grad * mask, rtol=1e-5, atol=1e-7)
    plain = micro_batch_loss(new[mask], torch.zeros(int(mask.sum())), build_micro_batch(seqs, [2] * 4, [0, 1, 2, 3]),
                             dataclasses.replace(batch, is_weights=None), mask, int(mask.sum()), eps_low=0.2, eps_high=0.28, dual_clip=None,
                             loss_type="gspo")[0]
    assert abs(float(plain) - total) > 1e-4  # the old log-probs instead would have given another loss


# ---- KL ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("spread", [0.5, 40.0])
def test_kl_estimators_equal_openrlhfs(theirs, shape, estimator, unbiased, spread):
    """Value and gradient of ``compute_approx_kl`` (the reference and the old policy around the policy; spread 40:
    log-ratios far past its clamps at -10 / +-10 and past exp's range in the importance weight)."""
    for seed in range(3):
        new, old, ref, _, mask = _batch(seed, *shape, spread=spread)
        kw = {"unbiased_gradient": unbiased}

        def ours(lp):
            return (approx_kl(lp, ref, estimator, old_log_probs=old, **kw) * mask).sum()

        def openrlhf(lp):
            return (theirs["compute_approx_kl"](lp, ref, log_probs_old=old, kl_estimator=estimator, **kw) * mask).sum()

        o, t = _both(ours, openrlhf, new)
        _close(o, t)
        assert torch.isfinite(o[1]).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coef", [0.0, 0.05, -0.1])
def test_kl_in_the_reward_equals_openrlhfs_compute_reward(theirs, shape, coef):
    """Per-token rewards: the outcome at the last valid token plus -coef x kl on every valid token (a negative
    coefficient is 0 on both sides)."""
    for seed in range(3):
        _, _, _, kl, mask = _batch(seed, *shape)
        r = torch.randn(shape[0], generator=torch.Generator().manual_seed(seed))
        ours = outcome_token_rewards(r, mask, kl_token_rewards(kl, mask, coef))
        openrlhf = theirs["compute_reward"](r, coef, kl, action_mask=mask) * mask
        torch.testing.assert_close(ours, openrlhf, rtol=0, atol=1e-6)


def test_adaptive_controller_equals_openrlhfs():
    from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController

    g = torch.Generator().manual_seed(0)
    ours, openrlhf = KLController(0.05, target=0.02, horizon=500), AdaptiveKLController(0.05, 0.02, 500)
    for kl in (torch.rand(30, generator=g) * 0.06).tolist() + [0.0, 1e3]:
        ours.update(kl, 64)
        openrlhf.update(kl, 64)
        assert ours.value == pytest.approx(float(openrlhf.value), rel=1e-12)


# ---- the step's metrics: OpenRLHF's ppo_train aggregation ---------------------------------------------------------

def test_step_metrics_weight_updates_by_tokens_as_openrlhf():
    """Three updates, the last a short tail: kl 0.02 over 400 tokens, 0.015 over 400, 0.002 over 40. OpenRLHF's
    status_mean weights its "token" metrics (policy_loss, kl, ppo_clip_ratio, ...) by tokens:
    (8 + 6 + 0.08) / 840 = 0.016762; the unweighted mean of the three (before) was 0.012333."""
    from openrlhf_source import openrlhf_status_mean

    from openrlhf_shape.trainer.ppo_trainer import _mean_metrics

    rows = [{"kl": 0.02, "loss": -0.3, "pg_clipfrac": 0.1, "num_tokens": 400.0, "grad_norm": 1.0},
            {"kl": 0.015, "loss": 0.1, "pg_clipfrac": 0.2, "num_tokens": 400.0, "grad_norm": 2.0},
            {"kl": 0.002, "loss": 0.9, "pg_clipfrac": 0.0, "num_tokens": 40.0, "grad_norm": 4.0}]
    ours = _mean_metrics(rows)
    assert ours["kl"] == pytest.approx(14.08 / 840, rel=1e-12)
    names = {"kl": "kl", "loss": "policy_loss", "pg_clipfrac": "ppo_clip_ratio"}  # ours -> OpenRLHF's
    status = [{**{names[k]: r[k] for k in names}, "_num_action_tokens": r["num_tokens"], "_num_samples": 4.0,
               "_weights": {v: "token" for v in names.values()}} for r in rows]
    openrlhf = openrlhf_status_mean(status)
    for k, v in names.items():
        assert ours[k] == pytest.approx(openrlhf[v], rel=1e-12), k
    assert ours["num_tokens"] == pytest.approx(840 / 3) and ours["grad_norm"] == pytest.approx(7 / 3)


# ---- the stop-properly penalty ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("coef", [0.0, 0.3, 1.0, -0.5, -3.0])
def test_stop_properly_penalty_equals_openrlhfs_apply_length_penalties(n, coef):
    """``--reward.stop_properly_penalty_coef``: OpenRLHF's ``apply_length_penalties`` with its own parsed args (the
    overlong penalty off: it is refused here) on experiences of 1-4 samples, against ours on the whole batch; raw
    rewards in [-15, 15], none / some / all truncated."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
    from openrlhf_source import openrlhf_args

    from openrlhf_shape.algorithms.length_penalty import stop_properly_penalty

    args = openrlhf_args(["--reward.stop_properly_penalty_coef", str(coef)])
    g = torch.Generator().manual_seed(n)
    rewards = torch.rand(n, generator=g) * 30 - 15
    for truncated in (torch.zeros(n, dtype=torch.bool), torch.rand(n, generator=g) < 0.5, torch.ones(n, dtype=torch.bool)):
        parts = torch.arange(n).split(4)
        exps = [Experience(rewards=rewards[i].clone(), truncated=truncated[i].clone(), info={}) for i in parts]
        apply_length_penalties(exps, args)
        theirs = torch.cat([e.rewards for e in exps])
        assert torch.equal(stop_properly_penalty(rewards, truncated, coef), theirs)


# ---- the dynamic filter ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lo, hi", [(0.0, 1.0), (0.2, 0.8), (0.25, 1.0)])
def test_dynamic_filter_keep_rule_equals_openrlhfs(tmp_path, tiny_tokenizer, lo, hi):
    """Groups of n = 4 whose scores sit on and inside the range's ends (mean 0, 0.25, 0.5, 0.75, 1, and scores that
    are not 0/1): the groups our rewards phase keeps are those OpenRLHF's filter keeps."""
    from openrlhf_source import openrlhf_dynamic_filter_keeps

    from openrlhf_shape.algorithms import ShapeConfig, get_estimator
    from openrlhf_shape.algorithms.length_penalty import RewardShaping
    from openrlhf_shape.batch import ExperienceBatch, length_mask
    from openrlhf_shape.data.prompts import PromptItem
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
    from openrlhf_shape.rollout.engine import SamplingConfig
    from openrlhf_shape.rollout.probes import ProbeConfig
    from openrlhf_shape.trainer.experience import ShapeExperienceMaker

    groups = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0.2, 0.2, 0.2, 0.2],
              [0.8, 0.8, 0.8, 0.8], [0.5, 0.0, 0.0, 0.5], [0.9, 0.6, 0.3, 0.2]]
    reward_file = tmp_path / "label_reward.py"  # the score is the label: the test chooses every sample's score
    reward_file.write_text("import torch\ndef reward_func(queries, prompts, labels, **kw):\n"
                           "    r = torch.tensor([float(x) for x in labels])\n"
                           "    return {'rewards': r, 'scores': r}\n")
    items = [PromptItem(index=i, prompt="p", prompt_ids=(5, 6), label=str(s)) for i, g in enumerate(groups) for s in g]
    exp = ExperienceBatch(items=items, sequences=[[5, 6, 7]] * len(items), prompt_lens=[2] * len(items),
                          texts=["x"] * len(items), response_mask=length_mask([1] * len(items), 1),
                          truncated=torch.zeros(len(items), dtype=torch.bool))
    reward = RewardComputer(RewardConfig(remote_url=str(reward_file), num_workers=1))
    try:
        maker = ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=4), ProbeConfig(), None,
                                     None, reward, tiny_tokenizer, shaping=RewardShaping(True, (lo, hi)))
        kept = maker.rewards(exp).value
    finally:
        reward.close()
    ours = sorted({it.index for it in kept.items})
    want = [i for i, g in enumerate(groups) if openrlhf_dynamic_filter_keeps(g, lo, hi)]
    assert ours == want and 0 < len(want) < len(groups)
