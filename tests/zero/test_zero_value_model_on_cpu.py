"""The value model (reward model / critic in OpenRLHF's format) on two DeepSpeed ranks, CPU/gloo: per-state values
of the ragged batch under ZeRO-2 and ZeRO-3 (every tensor partitioned) against the Hugging Face value model on the
same weights, a head drawn for a causal LM as the HF loader draws it, and the ZeRO-3 model's export in OpenRLHF's
format."""

from __future__ import annotations

import os

import pytest

from mg_helpers import TRAIN_CFG, VALUE_HEAD_SEED, VALUE_TOL, assert_value_export, hf_state_values, max_abs_diff
from openrlhf_shape.actor.rank_outputs import merge_value_outputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")  # value_scenarios.py
ZERO3 = {"zero_stage": 3, "zero3_param_persistence_threshold": 0}


@pytest.fixture(scope="module")
def ranks(tiny_value_model, tiny_models, ragged_batch, tmp_path_factory) -> dict:
    """Both ranks' results (``"res"``) and the ZeRO-3 model's export (``"export"``)."""
    from openrlhf_shape.actor.launch import run_ranks
    from support.preload import spawn_preloaded

    export = str(tmp_path_factory.mktemp("zero_value_export") / "zero3")
    res = run_ranks("value_scenarios:value_run", 2, timeout=600, env={"DS_ACCELERATOR": "cpu"},
                    extra_pythonpath=[HERE, MEGATRON_TESTS], spawner=spawn_preloaded,
                    kwargs=dict(backend="deepspeed", cfg={**TRAIN_CFG, "zero_stage": 2}, value_dir=tiny_value_model,
                                batch=ragged_batch, causal_dir=tiny_models["qwen3"], head_seed=VALUE_HEAD_SEED,
                                variants={"zero3": ZERO3}, export_dir=export))
    return {"res": res, "export": export}


@pytest.mark.parametrize("key", ["values", "zero3"])
def test_values_equal_hf_on_cpu(ranks, tiny_value_model, ragged_batch, key):
    got = merge_value_outputs([r[key] for r in ranks["res"]], len(ragged_batch["sequences"]))
    assert all(r[key] for r in ranks["res"])  # both data-parallel ranks scored their shard
    assert max_abs_diff(got, hf_state_values(tiny_value_model, ragged_batch)) <= VALUE_TOL
    assert got[3].shape == (1,)


def test_drawn_head_equals_hf_drawn_head_on_cpu(ranks, tiny_models, ragged_batch):
    got = merge_value_outputs([r["drawn"] for r in ranks["res"]], len(ragged_batch["sequences"]))
    assert max_abs_diff(got, hf_state_values(tiny_models["qwen3"], ragged_batch, head_seed=VALUE_HEAD_SEED)) <= VALUE_TOL


def test_export_is_openrlhf_value_format_on_cpu(ranks, tiny_value_model):
    """``export_hf`` of the ZeRO-3 value model (every tensor partitioned, gathered bucket by bucket) writes OpenRLHF's
    directory of the weights it loaded."""
    assert_value_export(ranks["export"], tiny_value_model)
