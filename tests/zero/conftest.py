"""Fixtures for the DeepSpeed backend tests: the Megatron tests' tiny models and ragged batch (same
recipe, so both backends see the same weights and the same tokens)."""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")
for path in (HERE, MEGATRON_TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)
ARCHS = ("qwen3", "qwen2", "llama")
TEMPERATURE = 0.7


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from openrlhf_shape.testing import make_tiny_model

    root = tmp_path_factory.mktemp("zero_models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=3, num_layers=2, vocab_size=1024)) for arch in ARCHS}


@pytest.fixture(scope="session")
def ragged_batch() -> dict:
    """7 sequences, 12..44 tokens, prompts of 2..9 tokens (one empty response)."""
    rng = random.Random(0)
    seqs, plens = [], []
    for i in range(7):
        length = rng.randint(12, 44)
        seqs.append([rng.randint(5, 1023) for _ in range(length)])
        plens.append(length if i == 3 else rng.randint(2, 9))
    return {"sequences": seqs, "prompt_lens": plens, "temperature": TEMPERATURE}
