"""The in-training held-out eval's arithmetic (avg@N pass@1, lengths, CIs) and its config flags."""

import os

import numpy as np
import pytest

from openrlhf_shape.eval.metrics import bootstrap_ci
from openrlhf_shape.config import load_config
from openrlhf_shape.trainer.heldout import group_results, heldout_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_group_results_regroups_interleaved_responses_by_problem():
    # responses arrive in any order; problem 1 has 2 of 2 correct, problem 0 has 1 of 2
    probs = group_results([1, 0, 1, 0], [1.0, 0.0, 1.0, 1.0], [10, 20, 30, 40], ["stop", "length", "stop", "stop"])
    assert [p.problem_id for p in probs] == ["0", "1"]
    assert probs[0].scores == [0.0, 1.0] and probs[0].num_tokens == [20, 40] and probs[0].truncated == 1
    assert probs[1].pass_rate == 1.0 and probs[1].mean_tokens == 20.0


def test_heldout_metrics_match_the_eval_package():
    rng = np.random.default_rng(3)
    n_problems, n = 50, 4
    index = np.repeat(np.arange(n_problems), n)
    scores = (rng.random(n_problems * n) < np.repeat(rng.random(n_problems), n)).astype(float)
    tokens = rng.integers(5, 100, n_problems * n)
    m = heldout_metrics(group_results(index.tolist(), scores.tolist(), tokens.tolist(), ["stop"] * len(index)), seed=7)
    per_problem = scores.reshape(n_problems, n).mean(axis=1)
    assert m["eval/accuracy"] == pytest.approx(scores.mean())
    assert (m["eval/accuracy_ci_low"], m["eval/accuracy_ci_high"]) == pytest.approx(bootstrap_ci(per_problem, seed=7))
    assert m["eval/accuracy_ci_low"] < m["eval/accuracy"] < m["eval/accuracy_ci_high"]
    assert m["eval/response_length/mean"] == pytest.approx(tokens.mean())
    assert m["eval/response_length_ci_low"] < tokens.mean() < m["eval/response_length_ci_high"]
    assert m["eval/num_problems"] == n_problems and m["eval/samples_per_problem"] == n
    assert m["eval/truncated_rate"] == 0.0


def test_group_results_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 prompt indices, 1 scores"):
        group_results([0, 0], [1.0], [3, 4])


def test_learn_preset_evaluates_before_training_with_sampling():
    cfg = load_config(os.path.join(ROOT, "configs", "cpu-learn.yaml"))
    e = cfg.eval
    assert e.val_before_train and e.n_samples_per_prompt == 8 and e.temperature == 0.6 and (e.top_p, e.top_k) == (0.95, 40)
    assert cfg.eval.max_samples == 100 and cfg.vllm.kv_cache_gib == 1


def test_eval_flags_are_validated():
    with pytest.raises(ValueError, match="--eval.n_samples_per_prompt"):
        load_config(os.path.join(ROOT, "configs", "cpu-learn.yaml"), ["--eval.n_samples_per_prompt", "0"])
    with pytest.raises(ValueError, match="--eval.max_samples"):
        load_config(os.path.join(ROOT, "configs", "cpu-learn.yaml"), ["--eval.max_samples", "0"])
