"""OpenRLHF's value-model format (``actor/value_model.py``) against OpenRLHF 0.11.2's own classes.

A tiny Qwen3 becomes a reward model through OpenRLHF's ``get_llm_for_sequence_regression`` (its head drawn as
OpenRLHF's ``init_value_head`` does, under a non-default ``value_head_prefix`` kept in config.json with a reward
mean / std), saved as OpenRLHF's strategy saves it; our loader reads that directory and its values, rewards and
normalisation must equal OpenRLHF's forward on the same padded batch. The other way, our saved value network must
load in OpenRLHF's loader and give our values.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from openrlhf_shape.actor.value_model import (ValueHeadFormat, load_value_model, save_value_model,
                                              sequence_rewards)
from support.openrlhf_value_source import openrlhf_save, openrlhf_sequence_regression

MEAN, STD, PREFIX = 0.25, 3.0, "value_head"


@pytest.fixture(scope="module")
def openrlhf_rm_dir(tiny_models, tmp_path_factory) -> str:
    """A tiny Qwen3 reward model built and saved by OpenRLHF's code (bf16, as OpenRLHF loads)."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    build = openrlhf_sequence_regression()
    model = build(tiny_models["qwen3"], "reward", param_dtype="bf16", attn_implementation="sdpa",
                  init_value_head=True, value_head_prefix=PREFIX)
    model.config.mean, model.config.std, model.config.value_head_prefix = MEAN, STD, PREFIX
    out = str(tmp_path_factory.mktemp("openrlhf_rm") / "rm")
    openrlhf_save(model, out, AutoTokenizer.from_pretrained(tiny_models["qwen3"]))
    return out


def _openrlhf_model(hf_dir: str, kind: str, normalize: bool):
    """OpenRLHF's model of ``hf_dir`` in float32, eval mode. Its mean/std buffers are non-persistent and filled in
    ``__init__``, which transformers 5 runs on the meta device: they load as garbage, so they are set from
    config.json as that ``__init__`` intends."""
    model = openrlhf_sequence_regression()(hf_dir, kind, param_dtype="bf16", attn_implementation="sdpa",
                                            normalize_reward=normalize).float().eval()
    if hasattr(model.config, "mean"):
        model.mean.fill_(model.config.mean)
        model.std.fill_(model.config.std)
    return model


def _padded(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenRLHF's layout: prompts left-padded, responses right-padded -> ids, attention mask ``[B, P + A]``,
    action mask ``[B, A]``."""
    seqs, plens = batch["sequences"], batch["prompt_lens"]
    p_max = max(plens)
    a_max = max(len(s) - p for s, p in zip(seqs, plens))
    ids = torch.zeros(len(seqs), p_max + a_max, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, p_max - p:p_max + len(s) - p] = torch.tensor(s)
        attn[i, p_max - p:p_max + len(s) - p] = 1
    return ids, attn, attn[:, p_max:].clone()


def _our_values(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Our model's raw values ``[L]`` per sequence, each run alone (no padding)."""
    with torch.no_grad():
        return [model(torch.tensor([s]), torch.arange(len(s))[None])[0] for s in seqs]


def test_reward_equals_openrlhf_reward_model(openrlhf_rm_dir, ragged_batch):
    ours = load_value_model(openrlhf_rm_dir, dtype=torch.float32)
    assert ours.fmt == ValueHeadFormat(PREFIX, MEAN, STD)  # config.json's prefix wins over the default "score"
    ids, attn, _ = _padded(ragged_batch)
    theirs = _openrlhf_model(openrlhf_rm_dir, "reward", normalize=True)
    with torch.no_grad():
        expected = theirs(ids, attn)
    states = [v[p - 1:] for v, p in zip(_our_values(ours, ragged_batch["sequences"]), ragged_batch["prompt_lens"])]
    got = sequence_rewards(states, ours.fmt, normalize=True)  # compute_values' layout: the states P - 1 .. L - 1
    assert expected.abs().max() > 0.05  # a real signal, not zeros
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        raw = _openrlhf_model(openrlhf_rm_dir, "reward", normalize=False)(ids, attn)
    torch.testing.assert_close(sequence_rewards(states, ours.fmt, normalize=False), raw, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(raw, expected)  # the statistics matter: mean 0.25, std 3


def _critic_rows(values: list[torch.Tensor], batch: dict, width: int) -> torch.Tensor:
    """Our per-sequence values as OpenRLHF's critic lays them out: response token j's value is the value at the
    position before it, right-padded with zeros to ``[B, width]``."""
    out = torch.zeros(len(values), width)
    for i, (v, p) in enumerate(zip(values, batch["prompt_lens"])):
        out[i, :len(v) - p] = v[p - 1:-1]
    return out


def test_per_token_values_equal_openrlhf_critic(openrlhf_rm_dir, ragged_batch):
    ours = load_value_model(openrlhf_rm_dir, dtype=torch.float32)
    ids, attn, action = _padded(ragged_batch)
    theirs = _openrlhf_model(openrlhf_rm_dir, "critic", normalize=False)
    with torch.no_grad():
        expected = theirs(ids, action, attn)
    got = _critic_rows(_our_values(ours, ragged_batch["sequences"]), ragged_batch, action.shape[1])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_saved_value_network_loads_in_openrlhf(openrlhf_rm_dir, ragged_batch, tmp_path):
    ours = load_value_model(openrlhf_rm_dir, dtype=torch.float32)
    with torch.no_grad():
        ours.head.weight.mul_(-2.0)  # a trained head: what is saved must be this one, not the loaded one
    out = str(tmp_path / "critic")
    save_value_model(ours, out, openrlhf_rm_dir, kind="critic", normalize=False)
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["architectures"], config["value_head_prefix"], config["mean"], config["std"]) == (
        ["CriticModel"], PREFIX, MEAN, STD)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    ids, attn, action = _padded(ragged_batch)
    with torch.no_grad():
        expected = _openrlhf_model(out, "critic", normalize=False)(ids, action, attn)
    got = _critic_rows(_our_values(ours, ragged_batch["sequences"]), ragged_batch, action.shape[1])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_causal_lm_needs_a_head_seed(tiny_models):
    with pytest.raises(ValueError, match="--ds.value_head_prefix"):
        load_value_model(tiny_models["qwen3"], dtype=torch.float32)
    a = load_value_model(tiny_models["qwen3"], dtype=torch.float32, head_seed=1)
    b = load_value_model(tiny_models["qwen3"], dtype=torch.float32, head_seed=1)
    assert a.fmt == ValueHeadFormat() and torch.equal(a.head.weight, b.head.weight)
    assert 0 < a.head.weight.std() < 3.0 / (a.decoder.config.hidden_size + 1)
