"""Fixtures for the data-layer tests: one tiny real tokenizer (ChatML) per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_shape.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", num_layers=1)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
