"""The reward model's flags (``--reward.model_name_or_path``, ``--reward.num_nodes``, ``--reward.num_gpus_per_node``,
``--reward.normalize_enable``: OpenRLHF 0.11.2's names, its parser holds them in test_openrlhf_flag_table.py): taken
into the config, and the combinations with one meaning only refused by flag."""

from __future__ import annotations

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.config.openrlhf import SAME, BY_NAME


def test_the_reward_model_flags_reach_the_config(tmp_path):
    rm = tmp_path / "rm"
    rm.mkdir()
    cfg = load_config(None, ["--reward.model_name_or_path", str(rm), "--reward.normalize_enable",
                             "--reward.num_nodes", "1", "--reward.num_gpus_per_node", "2",
                             "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2"])
    r = cfg.reward
    assert (r.model_name_or_path, r.normalize_enable, r.world_size(cfg.actor.world_size)) == (str(rm), True, 2)
    assert load_config(None, ["--reward.model_name_or_path", str(rm)]).reward.world_size(3) == 3  # unset: the actor's
    assert BY_NAME["reward.model_name_or_path"].kind == BY_NAME["reward.normalize_enable"].kind == SAME


def test_a_reward_model_and_a_reward_function_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match=r"--reward.model_name_or_path: and --reward.remote_url are two reward paths"):
        load_config(None, ["--reward.model_name_or_path", str(tmp_path), "--reward.remote_url", "http://x:1/get"])


def test_normalisation_needs_a_reward_model():
    with pytest.raises(ValueError, match=r"--reward.normalize_enable: .* needs\s+--reward.model_name_or_path|"
                                         r"--reward.normalize_enable: normalises a reward model's score"):
        load_config(None, ["--reward.normalize_enable"])


def test_colocated_reward_model_pairs_with_the_actor_ranks(tmp_path):
    with pytest.raises(ValueError, match=r"--reward.num_gpus_per_node: with --train.colocate_all the reward model"):
        load_config(None, ["--reward.model_name_or_path", str(tmp_path), "--train.colocate_all",
                           "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
                           "--reward.num_nodes", "1", "--reward.num_gpus_per_node", "1"])
    with pytest.raises(ValueError, match=r"--reward.model_name_or_path: .* is not a reward model directory"):
        load_config(None, ["--reward.model_name_or_path", str(tmp_path / "missing")])


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_value_head_prefix_and_offload_flags_reach_the_ranks(backend):
    """--ds.value_head_prefix reaches the rank config either backend's reward-model and critic ranks are handed (the
    workers read it when a directory's config.json names no head); --reward.offload / --ref.offload the config the
    lifecycle is built from (OpenRLHF 0.11.2's names and defaults: test_openrlhf_defaults.py)."""
    flags = ["--actor.backend", backend, "--ds.value_head_prefix", "value_head", "--reward.offload", "--ref.offload"]
    cfg = load_config(None, flags)
    assert cfg.backend().rank_config(cfg).value_head_prefix == "value_head"
    assert (cfg.reward.offload, cfg.ref.offload) == (True, True)
    plain = load_config(None, ["--actor.backend", backend])
    assert plain.backend().rank_config(plain).value_head_prefix == "score"
    assert (plain.reward.offload, plain.ref.offload) == (False, False)
    assert BY_NAME["ds.value_head_prefix"].kind == BY_NAME["reward.offload"].kind == BY_NAME["ref.offload"].kind == SAME
    with pytest.raises(ValueError, match="--ds.value_head_prefix must name a module attribute"):
        load_config(None, ["--ds.value_head_prefix", "value.head"])
