"""Fixtures for the rollout tests (the tiny Qwen3 and its tokenizer come from tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def chat_ids(tiny_tokenizer):
    """text -> ChatML prompt ids (generation prompt included), tokenised once."""

    def encode(text: str) -> list[int]:
        rendered = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tiny_tokenizer.encode(rendered, add_special_tokens=False)

    return encode
