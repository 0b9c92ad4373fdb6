"""What the experience maker, the schedules and partial rollouts need from their collaborators, as typed protocols.

The trainer builds the real ones (``trainer/setup.py:build_run``) and hands each consumer what it uses; a
consumer types its arguments with these, never with a concrete class, so a test or a new backend passes
anything of the same shape. ``tests/rollout/test_protocol.py`` holds the real classes to them, signature for
signature: :class:`~openrlhf_shape.rollout.group.EngineGroup` is :class:`Engines`,
:class:`~openrlhf_shape.rewards.computer.RewardComputer` is :class:`Rewards`, a Hugging Face tokenizer is
:class:`Tokenizer`.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.rewards.probe_scoring import ProbeAnswers
    from openrlhf_shape.rollout.engine import Generation, SamplingConfig, TailRun


class Tokenizer(Protocol):
    """The policy's tokenizer, as far as rollouts use it: decode responses and probe queries, encode the probe
    suffixes, and look up the vocabulary (the delimiter segmentation's ids)."""

    def __len__(self) -> int: ...

    def encode(self, text: str, text_pair: Any = None, add_special_tokens: bool = True, **kw: Any) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False, **kw: Any) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


class Engines(Protocol):
    """The rollout engines as one group: ``len`` engines behind one ``generate`` (rollouts, probes, agents'
    turns, partial rounds) and one ``score`` (what the engines compute for given sequences: the fidelity check);
    ``during`` and ``fault_metrics``: where a dead engine was replaced, and what recoveries cost."""

    def __len__(self) -> int: ...

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 affinity_keys: Sequence[Hashable] | None = None, max_tokens: Sequence[int] | None = None,
                 request_seeds: Sequence[int] | None = None) -> list[Generation]: ...

    def generate_with_probes(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                             tail: Any) -> TailRun:
        """``generate`` whose engines send each finished response's first probe round at once (rollout/tail.py)."""
        ...

    def score(self, token_ids: list[list[int]]) -> list[list[float]]: ...

    def get_tokenizer(self) -> Tokenizer: ...

    def during(self, phase: str | None = None, step: int | None = None) -> AbstractContextManager[None]:
        """Name the calls made inside the block (phase, step) where a dead engine is reported."""
        ...

    def fault_metrics(self) -> dict[str, float]:
        """The run's engine recoveries so far (``fault/engine_restarts``, ``fault/seconds_lost``)."""
        ...


class Rewards(Protocol):
    """The outcome reward path (``--reward.*``): answers judged with OpenRLHF's arguments (``compute`` ->
    ``{"rewards": [N], "scores": [N], "extra_logs": {name: float}}``), probe samples on the same path
    (``score_probes``) and Math-Verify alone (``score``: ``--probe.scorer math_verify``)."""

    def compute(self, queries: list[str], prompts: list[str], labels: list[str],
                responses: list[str] | None = None, sequences: Sequence[Sequence[int]] | None = None,
                **kw: Any) -> dict: ...

    def score(self, texts: list[str], labels: list[str], cache: dict | None = None) -> list[float]: ...

    def score_probes(self, answers: ProbeAnswers, cache: MutableMapping | None = None,
                     verifier: str = "reward") -> list[float]: ...
