"""The KL to the reference model in the experience maker's phases, on hand-made batches with real forwards:

* agents (``--train.agent_func_path``): only the model's own tokens carry a KL. An agent episode whose environment
  replies the reference model finds far less likely than the policy does (k3 > 5 per reply token, against 0.0002-3.6
  at the policy's tokens) gets no KL there: not in ``exp.kl``, the ``kl`` / ``logprobs_diff`` / ``ref/kl/*``
  metrics, the KL in the reward (GRPO and SHAPE), nor the KL in the loss (the actor's micro-batch loss).
* REINFORCE++ (``reinforce``) and ``reinforce_baseline`` take the KL rewards before their returns, discount and
  whitening, as OpenRLHF 0.11.2's ``compute_advantages_and_returns`` does (a worked batch by hand, and OpenRLHF's
  own method run from its installed source: tests/algorithms/openrlhf_source.py).

No engine: the phases ``logprobs`` -> ``ref_logprobs`` -> ``segment`` / ``advantages`` as a step runs them, the
policy and the reference plain Hugging Face forwards (tiny Qwen3 of seed 0 and of seed 1).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch
from openrlhf_shape.actor.micro_batch_loss import METRIC_KEYS, micro_batch_loss
from openrlhf_shape.algorithms import ReturnConfig, ShapeConfig, get_estimator
from openrlhf_shape.algorithms.kl import KLPenalty
from openrlhf_shape.batch import ExperienceBatch, KLLossTerm, length_mask
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.testing.hf_actor import HFActor
from openrlhf_shape.trainer.experience import ShapeExperienceMaker

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "algorithms"))

PROMPT = [5, 9]
# Row 0, an agent's episode: the policy's turns at columns 0-2 and 6-7, the environment's replies at 3-5 and 8-9
# (their ids: where the seed-1 reference disagrees most with the seed-0 policy). Row 1: a plain response.
RESPONSES = [[11, 12, 13, 772, 994, 429, 14, 15, 955, 706], [11, 12, 13, 14, 15, 16]]
POLICY = [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
R = [1.0, 0.0]  # one prompt, n = 2
COEF = 0.1


@pytest.fixture(scope="module")
def actors(tiny_model_dir, tmp_path_factory):
    from openrlhf_shape.testing import make_tiny_model

    ref_dir = make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_ref_seed1"), arch="qwen3", seed=1)
    return HFActor(tiny_model_dir), HFActor(str(ref_dir))


def _agent_batch() -> ExperienceBatch:
    lengths = [len(r) for r in RESPONSES]
    return ExperienceBatch(items=[None, None], sequences=[PROMPT + r for r in RESPONSES], prompt_lens=[2, 2],
                           texts=["", ""], response_mask=length_mask(lengths, max(lengths)), rewards=torch.tensor(R),
                           action_mask=torch.tensor(POLICY, dtype=torch.bool))


def _maker(actors, tokenizer, estimator: str = "grpo", in_loss: bool = False, kl: bool = True,
           cfg: ShapeConfig | None = None, returns: ReturnConfig | None = None) -> ShapeExperienceMaker:
    policy, ref = actors
    return ShapeExperienceMaker(
        get_estimator(estimator, cfg or ShapeConfig(), returns), SamplingConfig(n=2, max_tokens=10), ProbeConfig(),
        engines=None, logprobs_fn=policy.compute_logprobs_and_entropy, reward=None, tokenizer=tokenizer,
        ref_logprobs_fn=ref.compute_logprobs_and_entropy if kl else None,
        kl=KLPenalty("k3", in_loss=in_loss) if kl else None)


def _hand_k3(actors) -> list[list[float]]:
    """Each response token's k3 = e^-r - 1 + r, r = log pi(y_t) - log pi_ref(y_t), from the two forwards."""
    out = []
    for seq in (PROMPT + r for r in RESPONSES):
        lp = [float(x) for x in actors[0].model(torch.tensor([seq])).logits[0].log_softmax(-1)[1:-1]
              .gather(-1, torch.tensor(seq[2:])[:, None]).squeeze(-1)]
        ref = [float(x) for x in actors[1].model(torch.tensor([seq])).logits[0].log_softmax(-1)[1:-1]
               .gather(-1, torch.tensor(seq[2:])[:, None]).squeeze(-1)]
        out.append([math.exp(-(a - b)) - 1 + (a - b) for a, b in zip(lp, ref)])
    return out


def _with_kl(maker: ShapeExperienceMaker, coef: float = COEF):
    exp = maker.logprobs(_agent_batch()).value
    return maker.ref_logprobs(exp, coef)


@torch.no_grad()
def test_environment_tokens_carry_no_kl(actors, tiny_tokenizer):
    k3 = _hand_k3(actors)
    env = [k for k, p in zip(k3[0], POLICY[0]) if not p]
    own = [k for row, pol in zip(k3, POLICY) for k, p in zip(row, pol) if p]
    assert min(env) > 5 and sum(env) > 3 * sum(own)  # the premise: the replies would dominate any KL they entered
    out = _with_kl(_maker(actors, tiny_tokenizer))
    exp, m = out.value, out.metrics
    for i, (row, pol) in enumerate(zip(k3, POLICY)):
        for t, (k, p) in enumerate(zip(row, pol)):
            assert float(exp.kl[i, t]) == (pytest.approx(k, rel=1e-4, abs=1e-5) if p else 0.0), (i, t)
    means = [sum(k for k, p in zip(row, pol) if p) / sum(pol) for row, pol in zip(k3, POLICY)]  # 5 and 6 tokens
    assert m["kl"] == m["ref/kl/mean"] == pytest.approx(sum(means) / 2, rel=1e-4)
    assert m["ref/kl/max"] == pytest.approx(max(own), rel=1e-4) and max(own) < min(env)
    diff = exp.old_log_probs - exp.ref_log_probs
    pol = torch.tensor(POLICY, dtype=torch.bool)
    want_diff = sum(float(diff[i][pol[i]].mean()) for i in range(2)) / 2
    assert m["logprobs_diff"] == pytest.approx(want_diff, rel=1e-5)
    assert abs(want_diff - float(diff[exp.response_mask].mean())) > 0.3  # the replies would have moved it


@torch.no_grad()
def test_kl_in_the_reward_charges_only_the_policys_tokens(actors, tiny_tokenizer):
    """GRPO: token t of the policy gets (R - mean) / (std + 1e-9) - coef x sum of k3 over the policy's tokens
    s >= t; the replies get 0. R = [1, 0]: (R - 0.5) / sqrt(0.5)."""
    k3 = _hand_k3(actors)
    maker = _maker(actors, tiny_tokenizer)
    out = maker.advantages(_with_kl(maker).value, None, None)
    for i, (row, pol) in enumerate(zip(k3, POLICY)):
        r = (R[i] - 0.5) / (math.sqrt(0.5) + 1e-9)
        for t in range(len(pol)):
            to_go = sum(k for k, p in zip(row[t:], pol[t:]) if p)
            want = r - COEF * to_go if pol[t] else 0.0
            assert float(out.value.advantages[i, t]) == pytest.approx(want, rel=1e-4, abs=1e-5), (i, t)
    assert out.metrics["kl_coef"] == COEF and out.metrics["adv/kl_return/mean"] < 0


@torch.no_grad()
def test_the_batch_applies_the_coefficient_of_its_reference_pass(actors, tiny_tokenizer):
    """The coefficient is handed to the batch's reference pass, once, and the batch carries it: a later batch given
    another value (the trainer's controller moved after an update, beside which this batch's credit may run in
    asynchronous training) changes neither this batch's advantages nor its logged ``kl_coef``. A reference pass
    without a coefficient, or a batch that carries none, is refused."""
    maker = _maker(actors, tiny_tokenizer)
    exp = _with_kl(maker).value
    assert exp.kl_coef == COEF
    want = maker.advantages(exp, None, None).value.advantages.clone()
    later = _with_kl(maker, 10 * COEF).value
    assert later.kl_coef == 10 * COEF
    assert not torch.equal(maker.advantages(later, None, None).value.advantages, want)  # the value matters
    out = maker.advantages(exp, None, None)
    assert torch.equal(out.value.advantages, want) and out.metrics["kl_coef"] == COEF
    with pytest.raises(ValueError, match="needs the batch's coefficient"):
        maker.ref_logprobs(maker.logprobs(_agent_batch()).value, None)
    exp.kl_coef = None
    with pytest.raises(RuntimeError, match="carries no KL coefficient"):
        maker.advantages(exp, None, None)


@torch.no_grad()
def test_shape_gains_the_policys_kl_to_go_after_tcr(actors, tiny_tokenizer):
    """SHAPE on the agent episode (segments and TCR over the policy's tokens): with KL in the reward the
    advantages are SHAPE's own plus -coef x the policy tokens' k3 still to come; nothing in the replies."""
    cfg = ShapeConfig(segmentation="uniform", num_segments=2, min_segment_len=1, alpha=0.3, gamma_min=0.9)
    with_kl, plain = _maker(actors, tiny_tokenizer, "shape", cfg=cfg), _maker(actors, tiny_tokenizer, "shape",
                                                                               kl=False, cfg=cfg)
    exp = _with_kl(with_kl).value
    boundaries = with_kl.segment(exp).value
    potentials = torch.tensor([[0.5, 0.25, 1.0], [0.5, 0.75, 0.0]])
    got = with_kl.advantages(exp, boundaries, potentials).value.advantages.clone()
    base = plain.advantages(plain.logprobs(_agent_batch()).value, boundaries, potentials).value.advantages
    pol = torch.tensor(POLICY, dtype=torch.bool)
    assert (base[~pol] == 0).all() and (got[~pol] == 0).all()
    k3 = _hand_k3(actors)
    for i, (row, p_row) in enumerate(zip(k3, POLICY)):
        for t in (t for t, p in enumerate(p_row) if p):
            to_go = sum(k for k, p in zip(row[t:], p_row[t:]) if p)
            assert float(got[i, t] - base[i, t]) == pytest.approx(-COEF * to_go, rel=1e-4, abs=1e-5), (i, t)


@torch.no_grad()
def test_kl_in_the_loss_sums_only_the_policys_tokens(actors, tiny_tokenizer):
    """KL in the loss: the advantages keep no KL, the train batch's loss mask is the policy's tokens, and the
    actor's micro-batch loss sums k3 (at the policy being trained: here the same weights) over those 11 only."""
    maker = _maker(actors, tiny_tokenizer, in_loss=True)
    out = _with_kl(maker)
    assert "kl" not in out.metrics  # in the loss the trainer logs the update's KL
    exp = maker.advantages(out.value, None, None).value
    for i in range(2):
        r = (R[i] - 0.5) / (math.sqrt(0.5) + 1e-9)
        assert torch.allclose(exp.advantages[i], torch.tensor(POLICY[i]) * r, atol=1e-6)
    batch = exp.train_batch([0, 1], temperature=1.0, kl_loss=KLLossTerm(COEF, "k3"))
    masks = batch.loss_mask.bool()
    assert masks.tolist() == [[bool(p) for p in row] for row in POLICY]
    mb = build_micro_batch(exp.sequences, exp.prompt_lens, [0, 1])
    new = torch.cat([exp.old_log_probs[i, :len(RESPONSES[i])] for i in range(2)])
    _, stats = micro_batch_loss(new, torch.zeros_like(new), mb, batch, masks, int(masks.sum()),
                                eps_low=0.2, eps_high=0.2, dual_clip=None)
    k3 = _hand_k3(actors)
    own = sum(k for row, pol in zip(k3, POLICY) for k, p in zip(row, pol) if p)
    assert stats["kl_tokens"] == 11 and stats["kl_sum"] == pytest.approx(own, rel=1e-4)
    assert set(METRIC_KEYS) >= {"kl_sum", "kl_tokens"}


# ---- REINFORCE++ and REINFORCE++-baseline: the KL rewards enter before the returns and the whitening
LENGTHS = [3, 2]
KL = [[0.2, 0.1, 0.4], [0.3, 0.5, 7.0]]  # 7.0 at row 1's padding: never read
COEF_R = 0.5


def _worked_batch() -> ExperienceBatch:
    exp = ExperienceBatch(items=[None, None], sequences=[[5, 6, 7, 8], [5, 6, 7]], prompt_lens=[1, 1],
                          texts=["", ""], response_mask=length_mask(LENGTHS, 3), rewards=torch.tensor([1.0, 0.0]))
    exp.kl, exp.kl_coef = torch.tensor(KL), COEF_R  # as the ref_logprobs phase leaves a batch
    return exp


def _worked_maker(actors, tokenizer, estimator: str, returns: ReturnConfig, n: int) -> ShapeExperienceMaker:
    policy, ref = actors
    return ShapeExperienceMaker(
        get_estimator(estimator, ShapeConfig(), returns), SamplingConfig(n=n, max_tokens=3), ProbeConfig(),
        engines=None, logprobs_fn=policy.compute_logprobs_and_entropy, reward=None, tokenizer=tokenizer,
        ref_logprobs_fn=ref.compute_logprobs_and_entropy, kl=KLPenalty("k1"))


def test_reinforce_baseline_whitens_returns_that_hold_the_kl(actors, tiny_tokenizer):
    """By hand, one prompt, n = 2, R = [1, 0], coef 0.5: r = R - 0.5 = [0.5, -0.5]; token rewards -0.5 x KL plus
    r at the last token: [-0.1, -0.05, 0.3 | -0.15, -0.75]; returns [0.15, 0.25, 0.3 | -0.9, -0.75]; mean -0.19;
    deviations [0.34, 0.44, 0.49 | -0.71, -0.56]; population variance 1.367 / 5 = 0.2734. (Adding the KL-to-go
    after the whitening, as before, gives [0.466, 0.566, 0.616 | -1.625, -1.475].)"""
    exp = _worked_maker(actors, tiny_tokenizer, "reinforce_baseline", ReturnConfig(), 2).advantages(
        _worked_batch(), None, None).value
    want = torch.tensor([[0.34, 0.44, 0.49], [-0.71, -0.56, 0.0]]) / math.sqrt(0.2734)
    torch.testing.assert_close(exp.advantages, want, rtol=0, atol=1e-5)


def test_reinforce_discounts_the_kl_then_whitens(actors, tiny_tokenizer):
    """By hand, n = 1, R = [1, 0], gamma 0.5, coef 0.5: token rewards [-0.1, -0.05, 0.8 | -0.15, -0.25]; returns
    G_t = rew_t + 0.5 G_{t+1}: [0.075, 0.35, 0.8 | -0.275, -0.25]; mean 0.14; deviations
    [-0.065, 0.21, 0.66 | -0.415, -0.39]; population variance 0.80825 / 5 = 0.16165."""
    exp = _worked_maker(actors, tiny_tokenizer, "reinforce", ReturnConfig(gamma=0.5), 1).advantages(
        _worked_batch(), None, None).value
    want = torch.tensor([[-0.065, 0.21, 0.66], [-0.415, -0.39, 0.0]]) / math.sqrt(0.16165)
    torch.testing.assert_close(exp.advantages, want, rtol=0, atol=1e-5)


CASES = [("reinforce", ["--algo.advantage.gamma", "0.9"], ReturnConfig(gamma=0.9), 1),
         ("reinforce", [], ReturnConfig(), 4),
         ("reinforce_baseline", [], ReturnConfig(), 4),
         ("reinforce_baseline", ["--algo.advantage.no_std_norm"], ReturnConfig(no_std_norm=True), 4),
         ("group_norm", [], ReturnConfig(), 4),
         ("rloo", [], ReturnConfig(), 4)]


@pytest.mark.parametrize("name, flags, returns, n", CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in CASES])
def test_the_makers_kl_in_the_reward_equals_openrlhfs(actors, tiny_tokenizer, name, flags, returns, n):
    """The maker's advantages phase against OpenRLHF's compute_advantages_and_returns with its KL rewards, on 8
    responses of up to 6 tokens (KL in [-0.1, 0.3], junk at the padding)."""
    from openrlhf_source import openrlhf_advantages

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 7, (8,), generator=g)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rewards = (torch.rand(8, generator=g) > 0.5).float()
    kl = torch.where(mask, torch.rand(8, 6, generator=g) * 0.4 - 0.1, torch.full((8, 6), 5.0))
    exp = ExperienceBatch(items=[None] * 8, sequences=[[5] + [6] * int(k) for k in lengths], prompt_lens=[1] * 8,
                          texts=[""] * 8, response_mask=mask, rewards=rewards.clone())
    exp.kl, exp.kl_coef = kl.clone(), COEF_R
    ours = _worked_maker(actors, tiny_tokenizer, "grpo" if name == "group_norm" else name, returns, n).advantages(
        exp, None, None).value.advantages
    argv = ["--algo.advantage.estimator", name, "--rollout.n_samples_per_prompt", str(n), *flags]
    theirs = openrlhf_advantages(argv, rewards, mask, torch.where(mask, kl, torch.zeros(())), COEF_R)
    assert torch.allclose(ours[mask], theirs[mask].float(), atol=1e-5), (ours, theirs)
    assert (ours[~mask] == 0).all()
