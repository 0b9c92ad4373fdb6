"""Helpers shared by the Megatron tests (HF references, launching layouts)."""

from __future__ import annotations

import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def hf_logprobs_entropy(model_dir: str, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reference: HF forward, float32, per response token log-prob and full-vocab entropy at T."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lps, ents = [], []
    with torch.no_grad():
        for seq, p in zip(batch["sequences"], batch["prompt_lens"]):
            logits = model(torch.tensor([seq])).logits[0].float() / batch["temperature"]
            logp = torch.log_softmax(logits, dim=-1)[p - 1 : len(seq) - 1]
            target = torch.tensor(seq[p:], dtype=torch.long)
            lps.append(logp.gather(-1, target[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.numel():
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return worst


def run_layout(world_size: int, timeout: float = 420, **kwargs) -> list[dict]:
    from openrlhf_shape.actor.launch import run_ranks

    return run_ranks("mg_scenarios:layout_run", world_size, kwargs=kwargs, timeout=timeout, extra_pythonpath=[HERE])

