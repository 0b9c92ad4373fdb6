"""The reward path with a reward model bound (``RewardComputer.attach_model``): answers and SHAPE/MRT's probe samples
scored on their token ids by the model's scores (here the Hugging Face value model of tests/conftest.py's tiny
reward model, the forward the reward-model ranks are held to), a sigmoid when SHAPE/MRT need R in [0, 1]."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
from openrlhf_shape.rewards.probe_scoring import ProbeAnswers

SEQS = [[5, 9, 14, 3], [5, 9, 2], [7, 7, 7, 7, 1], [5, 9, 14, 3]]


@pytest.fixture(scope="module")
def scores(tiny_value_model):
    """The HF value model's normalised value at each sequence's last token, and a log of the sequences it got."""
    from openrlhf_shape.actor.value_model import load_value_model, sequence_rewards

    model, seen = load_value_model(tiny_value_model, dtype=torch.float32), []

    def fn(sequences):
        seen.append([list(s) for s in sequences])
        with torch.no_grad():
            vals = [model(torch.tensor([s]), torch.arange(len(s))[None])[0, -1:] for s in sequences]
        return sequence_rewards(vals, model.fmt, normalize=True)

    fn.seen = seen
    return fn


def test_answers_get_the_models_score_raw_or_squashed(scores):
    rc = RewardComputer(RewardConfig(model_name_or_path="rm"))
    assert rc.scorer is None and rc.plugin is None  # no Math-Verify pool, no reward function
    rc.attach_model(scores, squash=False)
    out = rc.compute(["q"] * 4, ["p"] * 4, ["1"] * 4, sequences=SEQS)
    want = scores(SEQS)
    assert torch.equal(out["rewards"], want) and torch.equal(out["scores"], want)
    assert float(want.abs().max()) > 1 or bool((want < 0).any())  # a score a sigmoid visibly changes
    rc.attach_model(scores, squash=True)
    assert torch.allclose(rc.compute(["q"] * 4, ["p"] * 4, ["1"] * 4, sequences=SEQS)["rewards"], torch.sigmoid(want))
    with pytest.raises(ValueError, match="pass sequences="):
        rc.compute(["q"], ["p"], ["1"])


def test_probes_are_scored_once_per_distinct_sample(scores):
    rc = RewardComputer(RewardConfig(model_name_or_path="rm"))
    rc.attach_model(scores, squash=True)
    keys = [tuple(s) for s in SEQS]  # samples 0 and 3 are one sample
    answers = ProbeAnswers(texts=["x"] * 4, labels=["1"] * 4, keys=keys, sequence=lambda j: SEQS[j])
    cache: dict = {}
    before = len(scores.seen)
    got = rc.score_probes(answers, cache=cache)
    assert got == torch.sigmoid(scores(SEQS)).tolist()
    assert scores.seen[before] == SEQS[:3]  # the repeated sample went once
    assert rc.score_probes(answers, cache=cache) == got and len(scores.seen) == before + 2  # cached: no call
    with pytest.raises(ValueError, match="judges probe samples by their token ids"):
        rc.score_probes(ProbeAnswers(texts=["x"], labels=["1"]))
