"""``--ds.value_head_prefix`` and ``--reward.offload`` on a reward-model rank of either backend, CPU/gloo, world 1.

The reward model is built and saved by OpenRLHF 0.11.2's own code (``get_llm_for_sequence_regression`` with
``value_head_prefix="value_head"``), its config.json naming no prefix (what OpenRLHF's PPO critic save writes), so
only the flag finds the head, as in OpenRLHF. A rank configured from the flags as the trainer does (``TrainConfig``
-> the backend record's rank config): without the flag it refuses the directory naming the flag; with it, its
per-state values equal OpenRLHF's reward and critic forward under the same flag. Then a real ``Lifecycle`` drives
that rank as its reward group, not colocated: without ``--reward.offload`` its parameters stay resident and no
offload event runs; with it they are on host (storages emptied) before and after the forward and resident during
it, and the values are the same bit for bit. The rank's export (what ``--critic.save_value_network`` writes) keeps
the head under the flag's name, as OpenRLHF's save does, and loads in OpenRLHF's loader.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from openrlhf_shape.actor.rank_outputs import merge_value_outputs
from support.openrlhf_value_source import openrlhf_save, openrlhf_sequence_regression

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "value_head"


@pytest.fixture(scope="module")
def prefixed_rm_dir(tiny_models, tmp_path_factory) -> str:
    """A tiny Qwen3 reward model from OpenRLHF's code, head ``value_head.weight`` scaled to values of order 1,
    config.json without ``value_head_prefix``."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = openrlhf_sequence_regression()(tiny_models["qwen3"], "reward", param_dtype="bf16",
                                           attn_implementation="sdpa", init_value_head=True, value_head_prefix=PREFIX)
    with torch.no_grad():
        getattr(model, PREFIX).weight.mul_((model.config.hidden_size + 1) / 4)
    out = str(tmp_path_factory.mktemp("prefixed_rm") / "rm")
    openrlhf_save(model, out, AutoTokenizer.from_pretrained(tiny_models["qwen3"]))
    assert "value_head_prefix" not in json.load(open(os.path.join(out, "config.json")))
    return out


def _openrlhf(rm_dir: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenRLHF's reward (``[B]``) and critic values (``[B, A]``, right-padded) of ``batch`` under
    ``--ds.value_head_prefix value_head``, float32, prompts left-padded as OpenRLHF lays them out; the action mask."""
    seqs, plens = batch["sequences"], batch["prompt_lens"]
    p_max, a_max = max(plens), max(len(s) - p for s, p in zip(seqs, plens))
    ids = torch.zeros(len(seqs), p_max + a_max, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, p_max - p:p_max + len(s) - p], attn[i, p_max - p:p_max + len(s) - p] = torch.tensor(s), 1
    action = attn[:, p_max:].clone()
    build = openrlhf_sequence_regression()
    out = []
    for kind, args in (("reward", (ids, attn)), ("critic", (ids, action, attn))):
        model = build(rm_dir, kind, param_dtype="bf16", attn_implementation="sdpa", value_head_prefix=PREFIX)
        with torch.no_grad():
            out.append(model.float().eval()(*args))
    return out[0], out[1], action


@pytest.fixture(scope="module", params=["megatron", "deepspeed"])
def rank_run(request, prefixed_rm_dir, ragged_batch, tmp_path_factory) -> dict:
    from openrlhf_shape.actor.launch import run_ranks
    from support.preload import spawn_preloaded

    export_dir = str(tmp_path_factory.mktemp("prefixed_export") / request.param)
    (res,) = run_ranks("forward_only_scenarios:prefix_and_offload_run", 1, timeout=600, extra_pythonpath=[HERE],
                       env={"DS_ACCELERATOR": "cpu"}, spawner=spawn_preloaded,
                       kwargs=dict(backend=request.param, value_dir=prefixed_rm_dir, prefix=PREFIX, batch=ragged_batch,
                                   export_dir=export_dir))
    return {**res, "export_dir": export_dir}


def test_without_the_flag_the_head_is_not_found_and_the_error_names_it(rank_run):
    assert "no value head 'score.weight'" in rank_run["error"] and "--ds.value_head_prefix" in rank_run["error"]


def test_with_the_flag_values_equal_openrlhfs_forward_under_it(rank_run, prefixed_rm_dir, ragged_batch):
    assert rank_run["info"]["value_head_prefix"] == PREFIX
    got = merge_value_outputs([rank_run["values"]], len(ragged_batch["sequences"]))
    reward, critic, action = _openrlhf(prefixed_rm_dir, ragged_batch)
    assert float(reward.abs().max()) > 0.05  # a real signal
    torch.testing.assert_close(torch.stack([v[-1] for v in got]), reward, atol=1e-4, rtol=1e-4)
    rows = torch.zeros_like(critic)
    for i, v in enumerate(got):
        rows[i, :len(v) - 1] = v[:-1]  # response token j's value: the state it is sampled from
    torch.testing.assert_close(rows * action, critic * action, atol=1e-4, rtol=1e-4)


def test_reward_offload_keeps_params_on_host_outside_the_forward_without_colocation(rank_run, ragged_batch):
    plain, off = rank_run["plain"], rank_run["offload"]
    assert plain["events"] == ["reward.forward"]  # not colocated, no flag: resident throughout
    assert plain["before"] == plain["during"][0] == plain["after"] > 0
    assert off["events"] == ["reward.offload(params)", "reward.onload(params)", "reward.forward",
                             "reward.offload(params)"]
    assert off["before"] == off["after"] == 0 and off["during"] == [plain["before"]]
    n = len(ragged_batch["sequences"])
    for a, b in zip(merge_value_outputs([plain["values"]], n), merge_value_outputs([off["values"]], n)):
        assert torch.equal(a, b)


def test_the_export_keeps_the_head_under_the_flags_name(rank_run, prefixed_rm_dir, ragged_batch):
    from openrlhf_shape.actor.value_model import read_checkpoint_tensor

    out = rank_run["export_dir"]
    assert json.load(open(os.path.join(out, "config.json")))["value_head_prefix"] == PREFIX
    assert read_checkpoint_tensor(out, f"{PREFIX}.weight") is not None and read_checkpoint_tensor(out, "score.weight") is None
    reward, critic, action = _openrlhf(out, ragged_batch)  # OpenRLHF's loader reads it back, same values
    want_reward, want_critic, _ = _openrlhf(prefixed_rm_dir, ragged_batch)
    torch.testing.assert_close(reward, want_reward, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(critic * action, want_critic * action, atol=1e-5, rtol=1e-5)
