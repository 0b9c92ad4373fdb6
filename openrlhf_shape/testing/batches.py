"""The deterministic token batches the backend cross-checks share (Megatron and DeepSpeed tests load
the same tiny models and feed both backends exactly these tokens, so their results compare)."""

from __future__ import annotations

import random

import torch

from openrlhf_shape.batch import TrainBatch

TEMPERATURE = 0.7


def ragged_batch(seed: int = 0, vocab_size: int = 1024) -> dict:
    """7 sequences of 12..44 token ids in [5, vocab_size), prompts of 2..9 tokens, sequence 3 all
    prompt (an empty response): ``{"sequences", "prompt_lens", "temperature"}``."""
    rng = random.Random(seed)
    seqs, plens = [], []
    for i in range(7):
        length = rng.randint(12, 44)
        seqs.append([rng.randint(5, vocab_size - 1) for _ in range(length)])
        plens.append(length if i == 3 else rng.randint(2, 9))
    return {"sequences": seqs, "prompt_lens": plens, "temperature": TEMPERATURE}


def train_batches(batch: dict, steps: int, seed: int) -> list[TrainBatch]:
    """``steps`` training batches over ``batch``'s sequences, the same on every rank and backend:
    old log-probs around log(1/1024) (-6.93 +- 0.3), standard-normal advantages, ~15% of response
    tokens masked out; per-token tensors are ``[response tokens]`` per sequence."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        resp = [len(s) - p for s, p in zip(batch["sequences"], batch["prompt_lens"])]
        old = [(-6.93 + 0.3 * torch.randn(t, generator=g)).float() for t in resp]
        adv = [torch.randn(t, generator=g).float() for t in resp]
        mask = [(torch.rand(t, generator=g) > 0.15) for t in resp]
        out.append(TrainBatch.from_ragged(batch["sequences"], batch["prompt_lens"], old, adv, mask,
                                          temperature=batch["temperature"]))
    return out


def long_batch(seed: int = 0, vocab_size: int = 1024) -> dict:
    """8 sequences of 33..1900 token ids (the packing tests: a micro-batch of long and short samples), prompts
    of 2..60 tokens, sequence 6 all prompt (an empty response): ``{"sequences", "prompt_lens", "temperature"}``."""
    rng = random.Random(seed)
    lengths = [1900, 700, 420, 300, 260, 150, 90, 33]
    seqs = [[rng.randint(5, vocab_size - 1) for _ in range(n)] for n in lengths]
    plens = [n if i == 6 else rng.randint(2, min(60, n - 1)) for i, n in enumerate(lengths)]
    return {"sequences": seqs, "prompt_lens": plens, "temperature": TEMPERATURE}
