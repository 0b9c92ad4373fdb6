"""What an OpenRLHF agent executor returns, read as OpenRLHF 0.11's rollout reads it (no engine): the prompt ends
where the first turn starts, the environment's replies are not the policy's tokens, tokens past ``max_length`` are
cut, rewards / scores / extra logs are numbers per episode; and the sampling parameters an executor passes are
honoured or refused by name. Loading follows OpenRLHF's rules (a .py file, ``AgentExecutor`` subclassing
``AgentExecutorBase``)."""

import os

import pytest
import torch

from openrlhf_shape.rollout.agent_batch import agent_metrics, episodes_to_batch, parse_episode
from openrlhf_shape.rollout.agents import (
    AgentError,
    BatchStats,
    initial_params,
    load_agent_executor,
    sampling_from_params,
)
from openrlhf_shape.rollout.engine import SamplingConfig

HERE = os.path.dirname(os.path.abspath(__file__))
AGENTS = os.path.join(HERE, "agent_files")


class Item:
    prompt, prompt_ids, label = "p", (1, 2, 3), "7"


def _output(**kw) -> dict:
    """An episode as MultiTurnAgentExecutor returns it: prompt 1 2 3, turn 10 11, reply 20 21, turn 12, reply 22."""
    out = {"observation_tokens": [1, 2, 3, 10, 11, 20, 21, 12, 22], "action_ranges": [(3, 5), (7, 8)],
           "reward": 1.0, "scores": torch.tensor([1.0]), "truncated": False,
           "rollout_log_probs": [0, 0, 0, -0.5, -0.25, 0, 0, -1.0, 0],
           "extra_logs": {"tool_calls": torch.tensor([2.0, 5.0]), "ok": True}}
    out.update(kw)
    return out


def test_episode_splits_prompt_turns_and_replies():
    ep = parse_episode(_output(), Item(), max_length=64, episode=0)
    assert ep.prompt_len == 3 and ep.sequence[:3] == [1, 2, 3]
    assert ep.action_mask == [True, True, False, False, True, False]
    assert ep.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, -1.0, 0.0]
    assert (ep.reward, ep.score, ep.turns, ep.env_tokens) == (1.0, 1.0, 2, 3)
    assert ep.extra_logs == {"tool_calls": 2.0, "ok": 1.0}  # a tensor's first element, as OpenRLHF logs it


def test_episode_is_cut_at_max_length_with_its_turns():
    ep = parse_episode(_output(), Item(), max_length=6, episode=0)
    assert ep.sequence == [1, 2, 3, 10, 11, 20] and ep.action_mask == [True, True, False] and ep.turns == 1
    assert ep.rollout_log_probs == [-0.5, -0.25, 0.0]


def test_batch_of_episodes_and_its_metrics():
    eps = [parse_episode(_output(), Item(), 64, 0),
           parse_episode(_output(action_ranges=[(3, 9)], reward=0.0, scores=None, extra_logs={}), Item(), 64, 1)]
    exp = episodes_to_batch(eps, tokenizer=type("T", (), {"decode": lambda self, ids, **kw: str(ids)})())
    assert exp.response_mask.tolist() == [[True] * 6, [True] * 6]
    assert exp.loss_mask().tolist() == [[True, True, False, False, True, False], [True] * 6]
    assert exp.rewards.tolist() == [1.0, 0.0] and exp.scores.tolist() == [1.0, 0.0]  # scores default to rewards
    m = agent_metrics(eps, BatchStats(engine_calls=2, requests=3, seconds=1.0))
    assert m["rollout/tokens"] == 3 + 6 and m["agent/env_tokens"] == 3
    assert m["agent/env_token_share"] == pytest.approx(3 / 12) and m["agent/turns/mean"] == 1.5
    assert m["agent/tool_calls"] == 2.0  # the mean over the episodes that report it


def test_bad_episodes_are_refused_with_the_reason():
    with pytest.raises(AgentError, match="no action"):
        parse_episode(_output(action_ranges=[]), Item(), 64, 0)
    with pytest.raises(AgentError, match="overlapping / out of order"):
        parse_episode(_output(action_ranges=[(3, 6), (5, 8)]), Item(), 64, 0)
    with pytest.raises(AgentError, match="one number per episode"):
        parse_episode(_output(reward=torch.tensor([1.0, 0.0])), Item(), 64, 0)
    eps = [parse_episode(_output(), Item(), 64, 0), parse_episode(_output(reward=None, scores=None), Item(), 64, 1)]
    with pytest.raises(AgentError, match="1 of 2 episodes returned no reward"):
        episodes_to_batch(eps, tokenizer=None)


def test_sampling_params_are_honoured_or_refused_by_name():
    sampling = SamplingConfig(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, logprobs=True, stop=["0"])
    params = initial_params(sampling)
    assert params.skip_special_tokens is False and params.logprobs == 0 and params.n == 1
    back = sampling_from_params(params)
    assert back == SamplingConfig(n=1, temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, logprobs=True, stop=["0"],
                                  skip_special_tokens=False)
    params.repetition_penalty, params.seed = 1.1, 3
    with pytest.raises(AgentError, match="repetition_penalty, seed"):
        sampling_from_params(params)


def test_agent_files_load_as_openrlhf_loads_them(tmp_path):
    from openrlhf.utils.agent import MultiTurnAgentExecutor

    assert isinstance(load_agent_executor(os.path.join(AGENTS, "calculator_agent.py")), MultiTurnAgentExecutor)
    bad = tmp_path / "no_executor.py"
    bad.write_text("x = 1\n")
    with pytest.raises(AgentError, match="must define `class AgentExecutor"):
        load_agent_executor(str(bad))
    with pytest.raises(AgentError, match="existing .py file"):
        load_agent_executor(str(tmp_path / "agent.txt"))
