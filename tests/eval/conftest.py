"""Fixtures for tests/eval: one tiny Qwen3 model dir (and its tokenizer) per session."""

from __future__ import annotations

from pathlib import Path

import pytest


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model(out, arch="qwen3", seed=0, num_layers=2, vocab_size=1024)
    return str(out)
