"""The GPU kit's MFU for a mixture-of-experts model counts the parameters a token runs through (router and
k experts), the planner's active parameters less the embeddings and norms (which the kit's formula leaves out)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from openrlhf_shape.planner.model import ModelShape

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import kit_models  # noqa: E402


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3-235B-A22B", "Qwen3-8B"])
def test_kit_matmul_params_are_the_active_ones(name):
    cfg = json.loads(open(kit_models.model_config_path(name)).read())
    m = ModelShape.from_dict(cfg)
    norms = m.layers * (2 * m.hidden + 2 * m.head_dim) + m.hidden  # two RMSNorms + q/k norms per layer, final norm
    assert kit_models.layer_matmul_params(cfg) == m.active_params() - 2 * m.vocab * m.hidden - norms
    if m.is_moe:
        assert kit_models.layer_matmul_params(cfg) < 0.15 * m.total_params()


def test_kit_counts_dense_layers_of_a_partly_sparse_model():
    cfg = json.loads(open(kit_models.model_config_path("Qwen3-30B-A3B")).read())
    cfg.update(num_hidden_layers=4, mlp_only_layers=[0, 2])
    m = ModelShape.from_dict(cfg)
    assert m.moe_layers == (1, 3)
    norms = m.layers * (2 * m.hidden + 2 * m.head_dim) + m.hidden
    assert kit_models.layer_matmul_params(cfg) == m.active_params() - 2 * m.vocab * m.hidden - norms
