"""What the engine-recovery tests compare and read: a call's samples by (prompt, sample), their equality to an
uninterrupted call's, and the trainer logger's warning lines while a block runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest


def samples(gens) -> dict:
    """``(prompt_index, sample_index) -> (token_ids, logprobs)`` of a group call's generations."""
    return {(g.prompt_index, g.sample_index): (g.token_ids, g.logprobs) for g in gens}


def assert_same_samples(got: dict, want: dict) -> None:
    """The same tokens and, the weights being the same, log-probs equal but for float noise (1e-5)."""
    assert got.keys() == want.keys()
    for key, (ids, lps) in got.items():
        assert ids == want[key][0], key
        assert lps == pytest.approx(want[key][1], abs=1e-5), key


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def console_lines() -> Iterator[list[str]]:
    """The warnings of the trainer's logger (which a configured run keeps from propagating) while the block runs."""
    handler, logger = _Lines(), logging.getLogger("openrlhf_shape")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
