"""Potential probes (docs/architecture.md, "Decisions and departures": potentials).

Phi(s) = mean verifier score of m forced-termination probes from state s = prompt + y[:b]. A probe
prompt is built in token space: prompt_ids + response_ids[:b] + suffix_ids, the suffix tokenised
once, so the prefix is exactly the state the policy saw and its KV blocks come from the prefix cache.
All probes of a step go to the engines in one batch, grouped by response (same affinity key as the
main rollout of that prompt, so they land on the engine that cached the prefix). With ``--shape.entropy_source
engine`` the first round is drawn earlier, inside the generate call, as each response finishes
(``rollout/tail.py``), and this module scores it with the rest; every sample's seed names its state, so both
orders draw the same tokens.

The verifier of a probe sample is the answer's (``--probe.scorer``, :class:`ProbeConfig`): the scorer gets each
round as :class:`~openrlhf_shape.rewards.probe_scoring.ProbeAnswers`, the forced answer for Math-Verify and, for a
reward function, OpenRLHF's query: the probe prompt (prompt + response prefix + suffix) and the sample's tokens,
decoded with special tokens kept, as the answer's query is the prompt and response tokens decoded so. To the
reward function a probe is a response that stopped at the boundary and was told to answer.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule, StateTally
from openrlhf_shape.rewards.probe_scoring import ProbeAnswers, score_key
from openrlhf_shape.rollout.engine import Generation, SamplingConfig
from openrlhf_shape.rollout.group import EngineGroup
from openrlhf_shape.rollout.seeds import derive_seed, probe_seed

# (response, boundary) -> the first probe round's samples of that state, drawn as its response finished, and whether
# they were sent while rollout responses still decoded on their engine (rollout/tail.py)
TailSamples = dict[tuple[int, int], tuple[list[Generation], bool]]
DEFAULT_THINK_SUFFIX = (
    "\n\nTime is up. I should stop thinking and give the final answer now.\n</think>\n\n"
    "The final answer is $\\boxed{"
)
DEFAULT_ANSWER_SUFFIX = "\n\nThe final answer is $\\boxed{"
PROBE_TEXT_PREFIX = "\\boxed{"  # the suffix opened the box; scoring re-attaches it to the probe text
PROBE_SCORERS = ("auto", "reward", "math_verify")  # --probe.scorer (ProbeConfig.scorer)
# Why --probe.scorer auto is refused with an agent under SHAPE/MRT, and what to choose (config/checks.py, the maker).
AGENT_PROBE_SCORER = (
    "--probe.scorer auto judges the probes with the answer's reward path, but with --train.agent_func_path an "
    "episode's reward comes from the agent's environment, which cannot judge a probe's forced answer. Name the probes' "
    "verifier: --probe.scorer reward (the reward function: --reward.remote_url's reward_func or server, else "
    "Math-Verify, on prompt + episode prefix + forced answer) or --probe.scorer math_verify (Math-Verify on the forced "
    "answer against the label); or train without probes (--algo.advantage.estimator group_norm)")


@dataclass
class ProbeConfig:
    """Probe settings (``--probe.*``). num_probes = m (samples per state: this class owns it); max_tokens
    per probe sample. The paper's defaults: m = 8 probes of 16 tokens.

    adaptive: probe in rounds and stop a state early once its estimate is certain enough
    (:class:`~openrlhf_shape.algorithms.adaptive_probes.AdaptiveProbeRule`: first round
    ``adaptive_first_round`` samples, then ``adaptive_round_size`` more while the Jeffreys posterior
    sd exceeds ``adaptive_tol``, at most ``max_probes``; 0 = num_probes). Off: the paper's fixed m.
    The adaptive defaults (4, 5, 9, 0.13) read "4 probes; when they agree stop, else 5 more": chosen
    with ``benchmarks/bench_adaptive_probes.py`` (docs/adaptive_probes.md, "Choosing the default").

    scorer: who judges the probes' forced answers. ``auto``: the answer's reward path (the reward function of
    ``--reward.remote_url``, else Math-Verify), so the potentials and R come from one verifier; refused with an
    agent (``--train.agent_func_path``), whose rewards come from its environment, which cannot judge a probe.
    ``reward``: the reward function (as ``auto``), also with an agent. ``math_verify``: Math-Verify on the
    forced answer against the label, whatever judges the answer.
    """

    num_probes: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    think_suffix: str = DEFAULT_THINK_SUFFIX
    answer_suffix: str = DEFAULT_ANSWER_SUFFIX
    think_end_token: str = "</think>"
    adaptive: bool = False
    adaptive_tol: float = 0.13
    max_probes: int = 9  # cap per state when adaptive; 0 = num_probes. 8/9 < gamma_min 0.9 keeps appendix A.2
    adaptive_first_round: int = 4
    adaptive_round_size: int = 5
    scorer: str = "auto"  # auto | reward | math_verify

    def rule(self) -> AdaptiveProbeRule | None:
        """The stopping rule when adaptive, else None (one round of num_probes)."""
        if not self.adaptive:
            return None
        cap = self.max_probes or self.num_probes
        return AdaptiveProbeRule(
            first_round=min(self.adaptive_first_round, cap),
            round_size=self.adaptive_round_size,
            max_probes=cap,
            tol=self.adaptive_tol,
        )

    def __post_init__(self) -> None:
        if not 1 <= self.num_probes <= 1024:
            raise ValueError(f"ProbeConfig.num_probes (m) must lie in [1, 1024], got {self.num_probes}")
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"ProbeConfig.max_tokens must lie in [1, 4096], got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"ProbeConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"ProbeConfig.top_p must be in (0, 1], got {self.top_p}")
        if not self.answer_suffix:
            raise ValueError("ProbeConfig.answer_suffix must be non-empty (it forces the final answer)")
        if not self.think_suffix:
            raise ValueError("ProbeConfig.think_suffix must be non-empty (it closes the thinking block)")
        if self.max_probes < 0:
            raise ValueError(f"--probe.max_probes must be >= 0 (0 = --probe.num_probes), got {self.max_probes}")
        if self.scorer not in PROBE_SCORERS:
            raise ValueError(f"--probe.scorer must be one of {', '.join(PROBE_SCORERS)}, got {self.scorer!r}")
        self.rule()  # validates the adaptive settings


@dataclass(frozen=True)
class ProbeSuffixes:
    """Suffixes tokenised once. ``think_end_id`` is the id of ``</think>`` or None when the vocab has
    none (then the answer suffix is always used)."""

    think_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    think_end_id: int | None

    @classmethod
    def from_tokenizer(cls, tokenizer, cfg: ProbeConfig) -> "ProbeSuffixes":
        vocab = tokenizer.get_vocab()
        think_end_id = vocab.get(cfg.think_end_token)
        think_ids = tuple(tokenizer.encode(cfg.think_suffix, add_special_tokens=False))
        answer_ids = tuple(tokenizer.encode(cfg.answer_suffix, add_special_tokens=False))
        if think_end_id is not None and think_end_id not in think_ids:
            raise ValueError(
                f"ProbeConfig.think_suffix does not tokenise to a suffix containing {cfg.think_end_token!r} "
                f"(id {think_end_id}); a probe from inside the thinking block must close it"
            )
        return cls(think_ids=think_ids, answer_ids=answer_ids, think_end_id=think_end_id)

    def suffix_for(self, prefix_ids: Sequence[int]) -> tuple[int, ...]:
        """Answer suffix when the response prefix already closed thinking (or no thinking format)."""
        if self.think_end_id is None or self.think_end_id in prefix_ids:
            return self.answer_ids
        return self.think_ids


def build_probe_prompt(
    prompt_ids: Sequence[int], response_ids: Sequence[int], boundary: int, suffixes: ProbeSuffixes
) -> list[int]:
    """prompt_ids + response_ids[:boundary] + suffix ids (pure). boundary 0 = the prompt alone.
    The suffix is chosen by whether ``</think>`` occurs in response_ids[:boundary]."""
    if not 0 <= boundary <= len(response_ids):
        raise ValueError(f"boundary {boundary} outside [0, {len(response_ids)}] (response length)")
    prefix = list(response_ids[:boundary])
    return [*prompt_ids, *prefix, *suffixes.suffix_for(prefix)]


@dataclass
class PotentialResult:
    """potentials[i]: float32 [K_i + 1] = (Phi(s_0), Phi at each interior boundary, R_i).
    probe_scores[i]: float32 [K_i, cap] raw per-sample scores of the probed states (row 0 = prompt),
    cap = m (fixed) or max_probes (adaptive; samples never drawn are NaN).
    stats: ``probe/*`` counters under the names the trainer logs (tokens summed over all samples;
    ``probe/tokens`` are decode tokens, ``probe/seconds`` = generate + score)."""

    potentials: list[torch.Tensor]
    probe_scores: list[torch.Tensor]
    stats: dict[str, float] = field(default_factory=dict)


def _score(scorer, answers: ProbeAnswers, cache: dict) -> list[float]:
    """A round's values: ``scorer.score_probes(answers, cache=)`` (a RewardComputer: the answer's reward path),
    else ``scorer.score`` / ``scorer`` called on the forced answers ``(texts, labels)`` (with ``cache=`` if taken)."""
    if hasattr(scorer, "score_probes"):
        return list(scorer.score_probes(answers, cache=cache))
    fn = scorer.score if hasattr(scorer, "score") else scorer
    if not callable(fn):
        raise TypeError("scorer must have .score_probes(answers), .score(texts, labels) or be "
                        "callable(texts, labels) -> list[float]")
    try:
        takes_cache = "cache" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_cache = False
    texts, labels = answers.texts, answers.labels
    return list(fn(texts, labels, cache=cache) if takes_cache else fn(texts, labels))


def estimate_potentials(
    engines: EngineGroup,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    boundaries: list[list[int]],
    labels: list[str],
    outcomes: list[float],
    scorer: Callable | object,
    cfg: ProbeConfig,
    suffixes: ProbeSuffixes | None = None,
    policy_tokens: list[list[bool]] | None = None,
    seed: int | None = None,
    prompts: list[str] | None = None,
    tokenizer=None,
    tail: TailSamples | None = None,
) -> PotentialResult:
    """Probe every state of a step in one batch and return Phi per boundary.

    prompt_ids[i] / response_ids[i] / labels[i] / outcomes[i] describe response i; boundaries[i] are
    its interior boundaries (sorted, 0 < b < T_i). Phi(s_0) is probed once per distinct prompt and
    shared by all its samples; the last potential is outcomes[i] with no probe.
    ``policy_tokens[i]`` (agents: ``[T_i]``, True at the policy's own tokens, False in the environment's
    replies): every boundary must sit at a policy token, so a probe's prefix ends in the policy's turn or
    right after a whole reply, never inside one (refused otherwise). ``seed``: the probes' seed
    stream (``rollout/seeds.py``): sample j of the round that starts at sample c of the state (response i, boundary b)
    samples with ``probe_seed(derive_seed(seed, c), i, b, j)``, so the potentials repeat whatever the engines and
    whenever the samples were drawn; None: the engines' own generators. ``tail``: the first round's samples of every
    state, drawn already as each response finished (``rollout/tail.py``, ``--shape.entropy_source engine``); the
    first round then only scores them (later adaptive rounds sample here).
    ``prompts[i]``: response i's prompt text (a reward function's ``prompts``; needed when ``scorer`` is a
    reward plug-in); ``tokenizer`` decodes the probe queries for it (None: the engines').
    """
    n = len(response_ids)
    _check_probe_inputs(prompt_ids, response_ids, boundaries, labels, outcomes)
    if policy_tokens is not None:
        _check_states_in_policy_turns(boundaries, policy_tokens, response_ids)
    if prompts is not None and len(prompts) != n:
        raise ValueError(f"estimate_potentials: len(prompts)={len(prompts)} != len(response_ids)={n}")
    if suffixes is None:
        tokenizer = tokenizer or engines.get_tokenizer()
        suffixes = ProbeSuffixes.from_tokenizer(tokenizer, cfg)
    batch = _probe_requests(prompt_ids, response_ids, boundaries, labels, suffixes, prompts)
    queries = _ProbeQueries(lambda: tokenizer or engines.get_tokenizer(), batch.requests)
    run = _run_probe_rounds(engines, batch, scorer, cfg, seed, queries, tail)
    phi = torch.tensor([t.estimate() for t in run.tallies], dtype=torch.float32)

    potentials, probe_scores = [], []
    for i in range(n):
        rows = torch.tensor(batch.state_req[i], dtype=torch.long)
        potentials.append(torch.cat([phi[rows], torch.tensor([float(outcomes[i])], dtype=torch.float32)]))
        probe_scores.append(run.score_mat[rows].clone())
    return PotentialResult(potentials=potentials, probe_scores=probe_scores, stats=run.stats())


def _check_probe_inputs(prompt_ids: list[list[int]], response_ids: list[list[int]], boundaries: list[list[int]],
                        labels: list[str], outcomes: list[float]) -> None:
    """One entry per response in every list; boundaries strictly increasing inside each response."""
    n = len(response_ids)
    for name, seq in (("prompt_ids", prompt_ids), ("boundaries", boundaries), ("labels", labels), ("outcomes", outcomes)):
        if len(seq) != n:
            raise ValueError(f"estimate_potentials: len({name})={len(seq)} != len(response_ids)={n}")
    for i, bs in enumerate(boundaries):
        t = len(response_ids[i])
        if any(not 0 < b < t for b in bs) or list(bs) != sorted(set(bs)):
            raise ValueError(
                f"boundaries[{i}]={list(bs)} must be strictly increasing interior positions in (0, {t})"
            )


def _check_states_in_policy_turns(boundaries: list[list[int]], policy_tokens: list[list[bool]],
                                  response_ids: list[list[int]]) -> None:
    """Each boundary b of response i has ``policy_tokens[i][b]``: the state prompt + y[:b] is where the policy
    was about to sample y[b], so its last token is the policy's own or closes an environment reply."""
    if len(policy_tokens) != len(response_ids):
        raise ValueError(f"estimate_potentials: len(policy_tokens)={len(policy_tokens)} != {len(response_ids)}")
    for i, (bs, mask) in enumerate(zip(boundaries, policy_tokens)):
        if len(mask) != len(response_ids[i]):
            raise ValueError(f"policy_tokens[{i}] has {len(mask)} entries for a response of {len(response_ids[i])}")
        inside = [b for b in bs if not mask[b]]
        if inside:
            raise ValueError(f"boundaries {inside} of response {i} lie inside an environment reply (agents): a "
                             "probe's prefix would end mid-reply; segment the policy's tokens only")


@dataclass
class _ProbeRequests:
    """One request per probed state, grouped by response; the prompt-alone state once per prompt."""

    requests: list[list[int]] = field(default_factory=list)  # probe prompt token ids
    states: list[tuple[int, int]] = field(default_factory=list)  # (response, boundary): what each request probes
    keys: list[tuple[int, ...]] = field(default_factory=list)  # affinity key: the response's prompt ids
    labels: list[str] = field(default_factory=list)
    prompts: list[str] | None = None  # the prompt text of each request's response (None: not given)
    state_req: list[list[int]] = field(default_factory=list)  # per response: request index of each state (incl. s_0)

    def add(self, request: list[int], state: tuple[int, int], key: tuple[int, ...], label: str,
            prompt: str | None) -> int:
        self.requests.append(request)
        self.states.append(state)
        self.keys.append(key)
        self.labels.append(label)
        if self.prompts is not None:
            self.prompts.append(prompt)
        return len(self.requests) - 1


def _probe_requests(prompt_ids: list[list[int]], response_ids: list[list[int]], boundaries: list[list[int]],
                    labels: list[str], suffixes: ProbeSuffixes, prompts: list[str] | None = None) -> _ProbeRequests:
    """The probe prompts of every state of the step ([states] token-id lists) and which belong to which response."""
    out = _ProbeRequests(prompts=None if prompts is None else [])
    prompt_req: dict[tuple[int, ...], int] = {}
    for i in range(len(response_ids)):
        key, text = tuple(prompt_ids[i]), None if prompts is None else prompts[i]
        if key not in prompt_req:
            prompt_req[key] = out.add(build_probe_prompt(prompt_ids[i], response_ids[i], 0, suffixes), (i, 0), key,
                                      labels[i], text)
        elif out.labels[prompt_req[key]] != labels[i]:
            raise ValueError(f"response {i} shares its prompt with another response but has a different label")
        rows = [prompt_req[key]]
        for b in boundaries[i]:
            rows.append(out.add(build_probe_prompt(prompt_ids[i], response_ids[i], b, suffixes), (i, b), key,
                                labels[i], text))
        out.state_req.append(rows)
    return out


@dataclass
class _ProbeQueries:
    """OpenRLHF's query of a probe sample: its probe prompt and tokens decoded, special tokens kept. A probe prompt
    is decoded once for its consecutive samples (a round lists them state by state; only the last prompt's text is
    kept, a whole response prefix each); a sample's tokens are decoded after the prompt's last ``CONTEXT`` tokens
    and the context's own text cut off (what incremental detokenisers do), so the join equals decoding the whole
    sequence, leading spaces and merged characters included; where it would not, the whole sequence is decoded."""

    get_tokenizer: Callable[[], Any]  # called at the first query (a scorer that reads no queries needs none)
    requests: list[list[int]]
    last: tuple[int, str, str] | None = None  # (request, its text, its context's text)
    tokenizer: Any = None
    CONTEXT = 8

    def query(self, state: int, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            self.tokenizer = self.get_tokenizer()
        decode, ids = self.tokenizer.decode, self.requests[state]
        if self.last is None or self.last[0] != state:
            self.last = (state, decode(ids, skip_special_tokens=False),
                         decode(ids[-self.CONTEXT:], skip_special_tokens=False))
        _, text, context = self.last
        joined = decode([*ids[-self.CONTEXT:], *token_ids], skip_special_tokens=False)
        if joined.startswith(context):
            return text + joined[len(context):]
        return decode([*ids, *token_ids], skip_special_tokens=False)


@dataclass
class _ProbeRun:
    """What the probe rounds of one step drew: per-state tallies and raw scores ``[states, cap]`` (NaN where
    never drawn), and the counters behind ``probe/*`` (tokens summed over all samples, seconds)."""

    tallies: list[StateTally]
    score_mat: torch.Tensor
    cap: int
    cache: dict = field(default_factory=dict)  # values of distinct keys, shared by the rounds (see ProbeAnswers)
    distinct: set = field(default_factory=set)  # distinct keys counted here when the scorer keeps no cache
    rounds: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    decode: int = 0
    gen_time: float = 0.0
    tail_samples: int = 0  # first-round samples drawn inside the generate call, as their responses finished
    overlapped: int = 0  # of them, sent while rollout responses still decoded on their engine
    overlapped_tokens: int = 0  # their decode tokens
    score_time: float = 0.0

    def stats(self) -> dict[str, float]:
        """The ``probe/*`` counters under the names the trainer logs."""
        drawn = torch.tensor([t.n for t in self.tallies], dtype=torch.float32)
        mean_decode = self.decode / self.samples if self.samples else 0.0
        saved_samples = len(self.tallies) * self.cap - self.samples
        return {
            "probe/requests": float(len(self.tallies)),
            "probe/samples": float(self.samples),
            "probe/rounds": float(self.rounds),
            "probe/samples_per_state": float(drawn.mean()) if len(self.tallies) else 0.0,
            "probe/samples_saved": float(saved_samples),
            # decode tokens a fixed cap-sample budget would have spent beyond this one (mean per sample)
            "probe/tokens_saved": float(saved_samples * mean_decode),
            "probe/prompt_tokens": float(self.prompt_tokens),
            "probe/cached_tokens": float(self.cached),
            "probe/computed_prompt_tokens": float(self.prompt_tokens - self.cached),
            "probe/tokens": float(self.decode),
            "probe/prefix_hit_rate": self.cached / self.prompt_tokens if self.prompt_tokens else 0.0,
            "probe/seconds": self.gen_time + self.score_time,
            "probe/generate_seconds": self.gen_time,
            "probe/score_seconds": self.score_time,
            "probe/unique_answers": float(len(self.cache) or len(self.distinct)),
            # --shape.entropy_source engine (rollout/tail.py): probe work inside the generate phase, not after it
            "probe/tail_samples": float(self.tail_samples),
            "probe/overlapped_samples": float(self.overlapped),
            "probe/overlapped_tokens": float(self.overlapped_tokens),
            "probe/overlapped_share": self.overlapped / self.samples if self.samples else 0.0,
            # the rest ran after the generate phase (its last step's probes, the ordered path, later rounds)
            "probe/exposed_samples": float(self.samples - self.overlapped),
            "probe/exposed_tokens": float(self.decode - self.overlapped_tokens),
        }


def _run_probe_rounds(engines: EngineGroup, batch: _ProbeRequests, scorer: Callable | object, cfg: ProbeConfig,
                      seed: int | None = None, queries: _ProbeQueries | None = None,
                      tail: TailSamples | None = None) -> _ProbeRun:
    """Sample and score every state: one round of m (fixed), or rounds until the adaptive rule stops each state.
    ``seed``: see :func:`estimate_potentials`; ``queries``: the probe samples' queries for a reward function;
    ``tail``: the first round's samples, drawn already (:func:`estimate_potentials`)."""
    rule = cfg.rule()
    cap = rule.max_probes if rule is not None else cfg.num_probes
    checkpoints = rule.checkpoints() if rule is not None else [cap]
    run = _ProbeRun(tallies=[StateTally() for _ in batch.requests], cap=cap,
                    score_mat=torch.full((len(batch.requests), cap), float("nan"), dtype=torch.float32))
    active = list(range(len(batch.requests)))
    prev = 0
    for c in checkpoints:
        if not active:
            break
        k = c - prev
        t0 = time.perf_counter()
        gens = _draw_round(engines, batch, active, k, cfg, None if seed is None else derive_seed(seed, prev),
                           tail if prev == 0 else None, run)
        run.gen_time += time.perf_counter() - t0
        if len(gens) != len(active) * k:
            raise RuntimeError(f"engines returned {len(gens)} probe samples, expected {len(active) * k}")
        t1 = time.perf_counter()
        states = [active[r // k] for r in range(len(gens))]  # state-major, k samples each
        answers = _round_answers(batch, states, gens, queries)
        scores = _score(scorer, answers, run.cache)
        run.score_time += time.perf_counter() - t1
        if not run.cache:  # the scorer keeps no cache: count distinct (answer, label) keys here
            run.distinct.update(score_key(t, lab, 1 << 30)[0] for t, lab in zip(answers.texts, answers.labels))
        round_mat = torch.tensor(scores, dtype=torch.float32).view(len(active), k)
        for row, i in enumerate(active):
            run.score_mat[i, prev:c] = round_mat[row]
            run.tallies[i].add(round_mat[row].tolist())
        run.rounds += 1
        run.samples += len(gens)
        run.prompt_tokens += sum(g.num_prompt_tokens for g in gens)
        run.cached += sum(g.num_cached_tokens for g in gens)
        run.decode += sum(len(g.token_ids) for g in gens)
        if rule is None:
            active = []
        else:
            active = [i for i in active if not rule.can_stop(int(round(run.tallies[i].successes)), run.tallies[i].n)]
        prev = c
    return run


def _draw_round(engines: EngineGroup, batch: _ProbeRequests, active: list[int], k: int, cfg: ProbeConfig,
                stream: int | None, tail: TailSamples | None, run: _ProbeRun) -> list[Generation]:
    """``k`` samples of each state in ``active``, state-major: from ``tail`` (drawn as the responses finished; counted
    into ``run``'s overlap counters) or from the engines, one request per sample, sample j of state (i, b) seeded
    ``probe_seed(stream, i, b, j)`` (``rollout/seeds.py``; ``stream`` None: the engines' own generators)."""
    if tail is not None:
        missing = [batch.states[i] for i in active if batch.states[i] not in tail]
        if missing:
            raise RuntimeError(f"probe states {missing[:4]} (response, boundary) were not probed when their response "
                               "finished: the engines' segmentation and the segment phase disagree")
        drawn = [tail[batch.states[i]] for i in active]
        for samples, overlapped in drawn:
            run.tail_samples += len(samples)
            if overlapped:
                run.overlapped += len(samples)
                run.overlapped_tokens += sum(len(g.token_ids) for g in samples)
        return [g for samples, _ in drawn for g in samples]
    sampling = SamplingConfig(n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                              logprobs=False)
    seeds = None if stream is None else [probe_seed(stream, *batch.states[i], j) for i in active for j in range(k)]
    # one batch per round, in response order, each state keyed to its response's engine
    return engines.generate([batch.requests[i] for i in active for _ in range(k)], sampling,
                            affinity_keys=[batch.keys[i] for i in active for _ in range(k)], request_seeds=seeds)


def _round_answers(batch: _ProbeRequests, states: list[int], gens: Sequence,
                   queries: _ProbeQueries | None) -> ProbeAnswers:
    """A round's samples (``states[j]``: the request of sample ``gens[j]``) as the verifiers read them; a sample's
    key is its state and tokens (equal keys, equal queries), its query built when a reward function asks."""
    return ProbeAnswers(
        texts=[PROBE_TEXT_PREFIX + g.text for g in gens], labels=[batch.labels[s] for s in states],
        prompts=None if batch.prompts is None else [batch.prompts[s] for s in states],
        keys=[("reward", s, tuple(g.token_ids)) for s, g in zip(states, gens)],
        query=None if queries is None else (lambda j: queries.query(states[j], gens[j].token_ids)),
        sequence=None if queries is None else (lambda j: [*batch.requests[states[j]], *gens[j].token_ids]),
    )
