"""``--rollout.max_tokens_per_gpu``: the token budget of a forward-only micro-batch (the old log-probs pass), apart
from ``--train.max_tokens_per_gpu`` (training micro-batches); unset, it is the training budget (OpenRLHF's rule).

On each backend's real rank worker (world 1, CPU/gloo) the same batch under a small and a large forward budget:
the micro-batches follow the budget (as ``plan_micro_batches`` packs them) and the log-probs do not change
(right padding: causal attention never sees the pads), equal to Hugging Face's."""

from __future__ import annotations

import os

import pytest
import torch

from openrlhf_shape.actor.batching import plan_micro_batches
from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.config import load_config

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_BUDGET, BIG = 48, 4096


def test_forward_budget_is_the_training_one_unless_given():
    assert OptimConfig(micro_batch_max_tokens=96).forward_budget == 96
    assert OptimConfig(micro_batch_max_tokens=96, forward_max_tokens=4000).forward_budget == 4000
    with pytest.raises(ValueError, match="forward_max_tokens"):
        OptimConfig(forward_max_tokens=0)
    cfg = load_config(None, ["--train.max_tokens_per_gpu", "1000", "--rollout.max_tokens_per_gpu", "5000"])
    assert cfg.megatron_config().optim.forward_budget == 5000 and cfg.megatron_config().optim.micro_batch_max_tokens == 1000
    assert load_config(None, ["--train.max_tokens_per_gpu", "1000"]).zero_config().optim.forward_budget == 1000
    with pytest.raises(ValueError, match=r"--rollout\.max_tokens_per_gpu must be an integer >= 1"):
        load_config(None, ["--rollout.max_tokens_per_gpu", "0"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_rank_forward_follows_its_own_budget(backend, tiny_models, ragged_batch):
    from openrlhf_shape.actor.launch import run_ranks
    from openrlhf_shape.testing.hf_actor import HFActor
    from support.preload import spawn_preloaded

    cfg = dict(lr=1e-3, total_steps=2, micro_batch_max_tokens=TRAIN_BUDGET, entropy_chunk_size=16)
    out = run_ranks("forward_budget_scenarios:forward_budgets", 1, timeout=600, extra_pythonpath=[HERE],
                    spawner=spawn_preloaded,
                    kwargs=dict(backend=backend, cfg=cfg, model_dir=tiny_models["qwen3"], batch=ragged_batch,
                                budgets=[None, BIG]))[0]
    lengths = [len(s) for s in ragged_batch["sequences"]]
    want_small = len(plan_micro_batches(lengths, TRAIN_BUDGET))
    assert want_small >= 5 and len(plan_micro_batches(lengths, BIG)) == 1
    assert out[None]["micro_batches"] == want_small and out[BIG]["micro_batches"] == 1
    hf = HFActor(tiny_models["qwen3"]).compute_logprobs_and_entropy(SequenceBatch.coerce(ragged_batch))
    for res in (out[None], out[BIG]):
        got = dict(zip(res["indices"], res["log_probs"]))
        assert sorted(got) == list(range(len(lengths)))
        for i, ref in enumerate(hf.log_probs):
            assert torch.allclose(got[i], ref.float(), atol=1e-4), (i, float((got[i] - ref).abs().max()))
    small, big = (dict(zip(r["indices"], r["log_probs"])) for r in (out[None], out[BIG]))
    gap = torch.cat([small[i] - big[i] for i in small]).abs().max()  # the micro-batching leaves the numbers alone
    assert float(gap) < 1e-5, float(gap)
