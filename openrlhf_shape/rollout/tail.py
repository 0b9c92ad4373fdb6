"""Probes that start when their response ends (``--shape.entropy_source engine``; issue 49).

A rollout's batch empties as its responses finish: the last steps of a generate call decode a few long responses
with most slots free. With the engines' own entropies of the sampled tokens (``rollout/sampled_entropy.py``) a
finished response can be segmented at once, so its first probe round can run in those free slots, on the same
engine, while its prefix is in the prefix cache. :class:`TailProbes` is what an engine needs for that
(``VLLMEngine.generate_with_probes`` drives vLLM step by step and calls :meth:`TailProbes.states` per finished
response); the probes phase (``rollout/probes.py``) then scores those samples and runs any later adaptive round.

The result does not depend on when a response finished: the segmentation is the segment phase's, on the same
entropies (segmentation is per response), and every probe sample's seed names its state and sample
(``rollout/seeds.py:probe_seed``), as the probes phase seeds its own rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openrlhf_shape.algorithms.segmentation import Segmentation
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig, ProbeSuffixes, build_probe_prompt
from openrlhf_shape.rollout.seeds import derive_seed, probe_seed


@dataclass(frozen=True)
class TailProbes:
    """The first probe round of every response of a generate call, as the engine sends it (pickled to Ray engines).

    ``segmentation``: the run's (``--shape.segmentation``, bound once); ``suffixes``: the probe suffixes' ids;
    ``samples``: the first round's samples per state (m, or the adaptive rule's first round); ``temperature``,
    ``top_p``, ``max_tokens``: ``--probe.*``; ``stream``: the step's probe stream (``derive_seed(step seed,
    PROBES)``; None: the engines' own generators)."""

    segmentation: Segmentation
    suffixes: ProbeSuffixes
    samples: int
    temperature: float
    top_p: float
    max_tokens: int
    stream: int | None

    @classmethod
    def of(cls, segmentation: Segmentation, suffixes: ProbeSuffixes, cfg: ProbeConfig,
           stream: int | None) -> "TailProbes":
        rule = cfg.rule()
        # the probes phase's first checkpoint (an adaptive first round that could not stop is merged into the next)
        return cls(segmentation, suffixes, rule.checkpoints()[0] if rule is not None else cfg.num_probes,
                   cfg.temperature, cfg.top_p, cfg.max_tokens, stream)

    def sampling(self) -> SamplingConfig:
        """One probe sample's sampling settings (its seed comes from :meth:`seed`)."""
        return SamplingConfig(n=1, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)

    def seed(self, state: tuple[int, int], sample: int) -> int | None:
        """The seed of sample ``sample`` of the first round (which starts at sample 0) at ``state``."""
        return None if self.stream is None else probe_seed(derive_seed(self.stream, 0), *state, sample)

    def boundaries(self, token_ids: Sequence[int], entropies: Sequence[float]) -> list[int]:
        """The response's interior boundaries from its engine entropies ``[T]`` (nats), as the segment phase cuts."""
        ent = torch.tensor(list(entropies), dtype=torch.float32)[None]
        ids = torch.tensor(list(token_ids), dtype=torch.long)[None] if self.segmentation.needs_token_ids else None
        row = self.segmentation(ent, torch.ones_like(ent, dtype=torch.bool), ids)[0]
        return [int(b) for b in row.tolist() if b >= 0]

    def states(self, response: int, first: int, prompt_ids: Sequence[int], token_ids: Sequence[int],
               entropies: Sequence[float]) -> list[tuple[tuple[int, int], list[int]]]:
        """``((response, boundary), probe prompt ids)`` of every state of a finished response: the prompt alone,
        named by its prompt's ``first`` response of the step (probed once per prompt), then each boundary."""
        bounds = [0, *self.boundaries(token_ids, entropies)]
        return [((first if b == 0 else response, b), build_probe_prompt(prompt_ids, token_ids, b, self.suffixes))
                for b in bounds]
