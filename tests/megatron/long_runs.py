"""The long-batch Megatron launches that the packing, context-parallel and pad-token tests read, made once per test
session (``SharedResults``: the first module, or pytest-xdist worker, that asks makes one; the others load it).

All of them run the same tiny Qwen3 and Qwen3-MoE on the same tokens (``long_batch``: 8 sequences of 33..1900
tokens, 3853 in all, sequence 6 with an empty response), so one launch per world size serves every file:

- world 1: the reference of every layout (packed and padded passes, the logits watch, SDPA core attention, the MoE
  router losses, CP2's per-GPU budget of 1024 tokens) and the pad-token batch;
- world 2: CP2 (and SDPA with full recompute), CP2 x EP2 (router losses), TP2 + SP (the logits watch, router
  losses) and the pad-token batch under TP2 + SP;
- world 4: CP2 x DP2, CP2 x TP2 + SP, CP2 x PP2;
- DeepSpeed (ZeRO-2) world 1: the ring-attention tests' reference and the pad-token batch; world 2: packed and
  padded passes with the logits watch (tests/zero/test_zero_packing_on_cpu.py), then ring attention over the two
  ranks (and head stride 2 under ZeRO-3 with gradient checkpointing).

Each launch runs its layouts one after another on the same ranks (rank_sequence.py): the ~4.5 s Megatron import
and the rendezvous are paid once per launch, not once per layout. Results: layout name -> every rank's results
(cp_scenarios.cp_run's, packing_scenarios.megatron_packing_run's for the pad-token batch).
"""

from __future__ import annotations

import random
import os
from pathlib import Path

from openrlhf_shape.testing.batches import long_batch
from rank_sequence import run_sequence

# one step from the HF weights; no clipping, so the gradients compared are the step's own
LONG_CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=2048, max_norm=0.0,
                entropy_chunk_size=256)
PAD_CFG = {**LONG_CFG, "micro_batch_max_tokens": 256, "entropy_chunk_size": 64}
ARCHS = ("qwen3", "qwen3_moe")
CP2 = {"context_parallel_size": 2}
TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
CP_BUDGET = 1024  # tokens per GPU of the composed CP layouts: a CP2 micro-batch holds 2048
# MoE router losses on (the load-balancing and z losses, each with a weight that makes it visible in the gradient)
ROUTER_LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
PAD = 0  # the pad id of the tiny models (their config names it; HF's embedding zeroes that row)
PACKING = "packing_scenarios:megatron_packing_run"
CP_RUN = "cp_scenarios:cp_run"
ZERO_PACKING = "packing_scenarios:zero_packing_run"
RING_RUN = "ring_scenarios:ring_run"
ZERO2 = {"zero_stage": 2}
RING2 = {"zero_stage": 2, "ring_attn_size": 2}
# also with HF gradient checkpointing: the backward recomputes the attention (its all-gathers) inside the layout
STRIDE2_ZERO3 = {"ring_attn_head_stride": 2, "zero_stage": 3, "zero3_param_persistence_threshold": 0,
                 "gradient_checkpointing_enable": True}
ZERO_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zero")


def batch() -> dict:
    return long_batch(seed=0, vocab_size=1024)


def pad_batch() -> dict:
    """4 sequences of 41..120 tokens holding the pad id once in the prompt and three times in the response (never
    last): what test_pad_token_gradient_on_cpu.py feeds."""
    rng = random.Random(3)
    seqs, plens = [], []
    for n in (120, 90, 64, 41):
        seq = [rng.randint(5, 1023) for _ in range(n)]
        p = rng.randint(8, 20)
        for pos in (p // 2, p + 5, p + 17, n - 10):
            seq[pos] = PAD
        seqs.append(seq)
        plens.append(p)
    return {"sequences": seqs, "prompt_lens": plens, "temperature": 1.0}


def long_models(shared_results, tiny_models: dict) -> dict[str, str]:
    """The backend tests' tiny Qwen3 and a tiny Qwen3-MoE (2 layers, vocabulary 1024, seed 3), one per session."""

    def make(root: Path) -> dict[str, str]:
        from openrlhf_shape.testing import make_tiny_model

        moe = make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2, vocab_size=1024)
        return {"qwen3": tiny_models["qwen3"], "qwen3_moe": str(moe)}

    return shared_results.get("long_models", make)


def _launch(shared_results, key: str, world: int, runs: dict, deepspeed: bool = False) -> dict[str, list]:
    """``runs``: layout name -> (target, kwargs), run in this order on the same ``world`` ranks, once per session."""

    def make(_: Path) -> dict[str, list]:
        env = {"DS_ACCELERATOR": "cpu"} if deepspeed else None
        results = run_sequence(world, list(runs.values()), timeout=600 * len(runs), env=env,
                               extra_pythonpath=[ZERO_TESTS])
        return dict(zip(runs, results))

    return shared_results.get(key, make)


def shared_world1(shared_results, models: dict) -> dict[str, list]:
    """``world1``: packed/padded passes of both models with the watch on Qwen3, then the variants ``sdpa`` (Qwen3,
    SDPA core attention), ``router_losses`` (Qwen3-MoE) and ``cp_budget`` (both, 1024-token micro-batches);
    ``pad``: the pad-token batch (Qwen3)."""
    variants = {"sdpa": ({"local_attention": "sdpa"}, ["qwen3"]),
                "router_losses": (ROUTER_LOSSES, ["qwen3_moe"]),
                "cp_budget": ({"micro_batch_max_tokens": CP_BUDGET}, list(ARCHS))}
    runs = {"world1": (CP_RUN, dict(cfg=LONG_CFG, model_dirs=models, batch=batch(), watch_arch="qwen3",
                                    variants=variants)),
            "pad": (PACKING, dict(cfg=PAD_CFG, model_dirs={"qwen3": models["qwen3"]}, batch=pad_batch()))}
    return _launch(shared_results, "megatron_long_world1", 1, runs)


def shared_world2(shared_results, models: dict) -> dict[str, list]:
    """``cp2`` (both models; variant ``sdpa``: Qwen3 on SDPA with full activation recompute), ``cp2_ep2``
    (Qwen3-MoE, 1024 tokens per GPU; variant ``router_losses``), ``tp2_sp`` (both, the watch on Qwen3; variant
    ``router_losses``), ``pad_tp2_sp`` (the pad-token batch, Qwen3)."""
    sdpa = {"sdpa": ({"local_attention": "sdpa", "gradient_checkpointing_enable": True}, ["qwen3"])}
    router = {"router_losses": (ROUTER_LOSSES, ["qwen3_moe"])}
    moe = {"qwen3_moe": models["qwen3_moe"]}
    runs = {"cp2": (CP_RUN, dict(cfg={**LONG_CFG, **CP2}, model_dirs=models, batch=batch(), variants=sdpa)),
            "cp2_ep2": (CP_RUN, dict(cfg={**LONG_CFG, **CP2, "expert_model_parallel_size": 2,
                                          "micro_batch_max_tokens": CP_BUDGET}, model_dirs=moe, batch=batch(),
                                     variants=router)),
            "tp2_sp": (CP_RUN, dict(cfg={**LONG_CFG, **TP2_SP}, model_dirs=models, batch=batch(), watch_arch="qwen3",
                                    variants=router)),
            "pad_tp2_sp": (PACKING, dict(cfg={**PAD_CFG, **TP2_SP}, model_dirs={"qwen3": models["qwen3"]},
                                         batch=pad_batch()))}
    return _launch(shared_results, "megatron_long_world2", 2, runs)


def shared_world4(shared_results, models: dict) -> dict[str, list]:
    """``cp2_dp2`` (Qwen3), ``cp2_tp2_sp`` (both models), ``cp2_pp2`` (Qwen3, 1024 tokens per GPU: several
    micro-batches of unequal length in the pipeline)."""
    runs = {"cp2_dp2": (CP_RUN, dict(cfg={**LONG_CFG, **CP2}, model_dirs={"qwen3": models["qwen3"]}, batch=batch())),
            "cp2_tp2_sp": (CP_RUN, dict(cfg={**LONG_CFG, **CP2, **TP2_SP}, model_dirs=models, batch=batch())),
            "cp2_pp2": (CP_RUN, dict(cfg={**LONG_CFG, **CP2, "pipeline_model_parallel_size": 2,
                                          "micro_batch_max_tokens": CP_BUDGET}, model_dirs={"qwen3": models["qwen3"]},
                                     batch=batch()))}
    return _launch(shared_results, "megatron_long_world4", 4, runs)


def shared_zero_world1(shared_results, models: dict) -> dict[str, list]:
    """DeepSpeed ZeRO-2 at world 1: ``ring_world1`` (ring_scenarios.ring_run: one packed pass per model, HF's SDPA
    attention) and ``pad`` (packing_scenarios.zero_packing_run on the pad-token batch, Qwen3)."""
    runs = {"ring_world1": (RING_RUN, dict(cfg=LONG_CFG, zero=ZERO2, model_dirs=models, batch=batch())),
            "pad": (ZERO_PACKING, dict(cfg=PAD_CFG, zero=ZERO2, model_dirs={"qwen3": models["qwen3"]},
                                       batch=pad_batch()))}
    return _launch(shared_results, "zero_long_world1", 1, runs, deepspeed=True)


def shared_zero_world2(shared_results, models: dict) -> dict[str, list]:
    """DeepSpeed at world 2: ``zero2`` (ZeRO-2, packed and padded passes of both models, the watch on Qwen3) and
    ``ring2`` (ring attention over the two ranks, both models; variant ``stride2_zero3``: Qwen3, head stride 2,
    ZeRO-3, gradient checkpointing)."""
    runs = {"zero2": (ZERO_PACKING, dict(cfg=LONG_CFG, zero=ZERO2, model_dirs=models, batch=batch(),
                                         watch_arch="qwen3")),
            "ring2": (RING_RUN, dict(cfg=LONG_CFG, zero=RING2, model_dirs=models, batch=batch(),
                                     variants={"stride2_zero3": (STRIDE2_ZERO3, ["qwen3"])}))}
    return _launch(shared_results, "zero_long_world2", 2, runs, deepspeed=True)


def variant(results: list[dict], name: str) -> list[dict]:
    """A variant's results shaped as a layout's (with the ranks' coordinates)."""
    return [{**r["variants"][name], "ranks": r["ranks"]} for r in results]
