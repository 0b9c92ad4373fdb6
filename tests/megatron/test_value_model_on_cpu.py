"""The value model (reward model / critic in OpenRLHF's format) on Megatron ranks, CPU/gloo: per-state values of the
ragged batch at world 1, TP2 (and sequence parallel), PP2 against the Hugging Face value model on the same weights
(``actor/value_model.py``, itself held to OpenRLHF's classes in tests/actor/test_value_model.py)."""

from __future__ import annotations

import pytest
import torch

from mg_helpers import (HERE, TRAIN_CFG, VALUE_HEAD_SEED, VALUE_TOL, assert_value_export, hf_state_values,
                        max_abs_diff)
from openrlhf_shape.actor.rank_outputs import merge_value_outputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tiny_value_model, tiny_models, ragged_batch, tmp_path_factory) -> dict:
    from openrlhf_shape.actor.launch import run_ranks
    from rank_sequence import run_sequence
    from support.preload import spawn_preloaded

    out = tmp_path_factory.mktemp("mg_value_export")
    common = dict(backend="megatron", value_dir=tiny_value_model, batch=ragged_batch)
    world1 = run_ranks("value_scenarios:value_run", 1, timeout=300, extra_pythonpath=[HERE], spawner=spawn_preloaded,
                       kwargs=dict(cfg=TRAIN_CFG, causal_dir=tiny_models["qwen3"], head_seed=VALUE_HEAD_SEED,
                                   export_dir=str(out / "world1"), **common))
    tp2, pp2 = run_sequence(2, [
        ("value_scenarios:value_run", dict(cfg={**TRAIN_CFG, "tensor_model_parallel_size": 2},
                                           variants={"sp": {"sequence_parallel": True}},
                                           export_dir=str(out / "tp2"), **common)),
        ("value_scenarios:value_run", dict(cfg={**TRAIN_CFG, "pipeline_model_parallel_size": 2},
                                           export_dir=str(out / "pp2"), **common))],
        timeout=600)
    return {"world1": world1, "tp2": tp2, "pp2": pp2, "exports": out}


@pytest.mark.parametrize("layout,key", [("world1", "values"), ("tp2", "values"), ("tp2", "sp"), ("pp2", "values")])
def test_values_equal_hf_on_cpu(runs, tiny_value_model, ragged_batch, layout, key):
    n = len(ragged_batch["sequences"])
    got = merge_value_outputs([r[key] for r in runs[layout]], n)
    ref = hf_state_values(tiny_value_model, ragged_batch)
    assert float(torch.cat(ref).abs().mean()) > 0.1  # values of order 1, not a vanishing head
    assert max_abs_diff(got, ref) <= VALUE_TOL
    assert got[3].shape == (1,)  # the all-prompt sample: its one state, the reward model's score
    assert runs[layout][0]["info"]["value_head_prefix"] == "score"
    assert (runs[layout][0]["info"]["mean"], runs[layout][0]["info"]["std"]) == (0.5, 2.0)


def test_drawn_head_equals_hf_drawn_head_on_cpu(runs, tiny_models, ragged_batch):
    """A critic started from a causal LM: the rank draws the head as the HF loader does from the same seed."""
    got = merge_value_outputs([r["drawn"] for r in runs["world1"]], len(ragged_batch["sequences"]))
    assert max_abs_diff(got, hf_state_values(tiny_models["qwen3"], ragged_batch, head_seed=VALUE_HEAD_SEED)) <= VALUE_TOL


@pytest.mark.parametrize("layout", ["tp2", "pp2", "world1"])
def test_export_is_openrlhf_value_format_on_cpu(runs, tiny_value_model, tiny_models, layout):
    """``export_hf`` of a value model (``--critic.save_value_network``) writes OpenRLHF's directory: the weights
    of the model it holds under OpenRLHF's names (TP shards gathered, PP stages joined; world 1 holds the head drawn
    for the causal LM) and a config naming the head."""
    assert_value_export(str(runs["exports"] / layout), tiny_value_model if layout != "world1" else tiny_models["qwen3"],
                        head_seed=None if layout != "world1" else VALUE_HEAD_SEED)
