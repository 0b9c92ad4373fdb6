"""Helpers shared by the Megatron tests (HF references, launching layouts) and the Megatron runs that the
DeepSpeed cross-checks (tests/zero) compare against: made once per session (``SharedResults``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

TRAIN_STEPS = 5
SAVE_AT = 3
# lr high enough that 5 steps visibly move the tiny model; warm-up + cosine exercise the schedule (the variant whose
# warm-up starts above 0: lr / 2, lr, then the decay to min_lr)
TRAIN_CFG = dict(lr=2e-3, min_lr=2e-4, lr_warmup_steps=2, lr_scheduler="cosine_warmup_with_min_lr", total_steps=TRAIN_STEPS,
                 micro_batch_max_tokens=96, max_norm=1.0, entropy_chunk_size=16)
# Attention and activation switches are TransformerConfig settings, not process groups: the same ranks rebuild the
# models with each switch on (mg_scenarios.layout_run's ``variants``) instead of launching again.
SDPA = {"local_attention": "sdpa"}


def transformers_lrs(cfg: dict, steps: int) -> list[float]:
    """The LR of each of ``steps`` updates under transformers' own ``get_scheduler`` for a scenario config ``cfg``
    (its warm-up count and absolute ``min_lr``, as OpenRLHF hands them): what the workers must apply."""
    from transformers import get_scheduler

    from openrlhf_shape.testing.rank_configs import megatron_config

    optim = megatron_config(cfg).optim
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.adam.lr)
    sched = get_scheduler(optim.lr_scheduler, opt, num_warmup_steps=optim.warmup_steps,
                          num_training_steps=optim.total_steps, scheduler_specific_kwargs={"min_lr": optim.min_lr})
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def hf_logprobs_entropy(model_dir: str, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reference: HF forward, float32, per response token log-prob and full-vocab entropy at T."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lps, ents = [], []
    with torch.no_grad():
        for seq, p in zip(batch["sequences"], batch["prompt_lens"]):
            logits = model(torch.tensor([seq])).logits[0].float() / batch["temperature"]
            logp = torch.log_softmax(logits, dim=-1)[p - 1 : len(seq) - 1]
            target = torch.tensor(seq[p:], dtype=torch.long)
            lps.append(logp.gather(-1, target[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.numel():
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return worst


# The value-model tests (tests/megatron, tests/zero): values of order 1 held to 1e-4 of Hugging Face's, and the seed
# of the head drawn for a causal LM.
VALUE_TOL = 1e-4
VALUE_HEAD_SEED = 11


def hf_state_values(model_dir: str, batch: dict, head_seed: int | None = None) -> list[torch.Tensor]:
    """Hugging Face's raw values (``actor/value_model.py``, held to OpenRLHF's classes) of each sample's states
    P - 1 .. L - 1 (``[R + 1]``), float32."""
    from openrlhf_shape.actor.value_model import load_value_model

    model = load_value_model(model_dir, dtype=torch.float32, head_seed=head_seed)
    with torch.no_grad():
        return [model(torch.tensor([s]), torch.arange(len(s))[None])[0, p - 1:]
                for s, p in zip(batch["sequences"], batch["prompt_lens"])]


def assert_value_export(export_dir: str, source_dir: str, head_seed: int | None = None) -> None:
    """``export_dir`` is OpenRLHF's value-model directory of the HF value model of ``source_dir`` (its head drawn
    from ``head_seed`` for a causal LM): tensor for tensor under the same names, the config naming the head."""
    import json

    from openrlhf_shape.actor.value_model import load_value_model

    want = load_value_model(source_dir, dtype=torch.float32, head_seed=head_seed).state_dict()
    got = load_value_model(export_dir, dtype=torch.float32).state_dict()
    assert sorted(got) == sorted(want) and "score.weight" in got
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)
    config = json.load(open(os.path.join(export_dir, "config.json")))
    assert (config["architectures"], config["value_head_prefix"]) == (["CriticModel"], "score")


def run_layout(world_size: int, timeout: float = 420, **kwargs) -> list[dict]:
    from openrlhf_shape.actor.launch import run_ranks
    from support.preload import spawn_preloaded

    return run_ranks("mg_scenarios:layout_run", world_size, kwargs=kwargs, timeout=timeout, extra_pythonpath=[HERE],
                     spawner=spawn_preloaded)



def shared_world1(shared_results, tiny_models: dict, batch: dict) -> dict:
    """Megatron world 1 on the backend models: parity forward (with the flat-q/k/v negative control), 5 updates of
    ``TRAIN_CFG`` with a checkpoint after ``SAVE_AT``, a NaN step, the HF export and weight buckets, then the same
    parity and updates with activation recompute and with SDPA attention. ``root`` holds ``ckpt/`` and ``hf/``
    (read-only: copy before changing anything)."""

    def make(folder: Path) -> dict:
        res = run_layout(1, cfg=TRAIN_CFG, model_dirs=tiny_models, batch=batch, train_dir=tiny_models["qwen3"],
                         train_steps=TRAIN_STEPS, save_at=SAVE_AT, ckpt_root=str(folder / "ckpt"),
                         export_dir=str(folder / "hf"), bucket_bytes=200_000, wrong_qkv_arch="qwen3", nan_step=True,
                         reference_dir=tiny_models["llama"],
                         variants={"recompute": {"gradient_checkpointing_enable": True}, "sdpa": SDPA})
        return {"res": res, "root": str(folder)}

    out = shared_results.get("megatron_world1", make)
    return {"res": out["res"], "root": Path(out["root"])}


def shared_tp2(shared_results, tiny_models: dict, batch: dict) -> list[dict]:
    """Megatron TP2 on the backend models: parity forward and the 5 updates of ``TRAIN_CFG``, then again with
    sequence parallel, SDPA attention (2 query heads and 1 KV group per rank: GQA inside SDPA), and both."""
    return shared_world2(shared_results, tiny_models, batch)["tp2"]


def shared_world2(shared_results, tiny_models: dict, batch: dict) -> dict:
    """The world-2 layouts of the backend models, one launch on the same two ranks (rank_sequence.py): ``tp2``
    (:func:`shared_tp2`); ``pp2``: parity forward and the 5 updates (the reference model: qwen2); ``dp2_distopt``:
    DP2 with the distributed optimizer, the 5 updates with a checkpoint after ``SAVE_AT`` under ``root``/ckpt
    (read-only: the resume reads it)."""
    from rank_sequence import run_sequence

    def make(folder: Path) -> dict:
        common = dict(model_dirs=tiny_models, batch=batch, train_dir=tiny_models["qwen3"], train_steps=TRAIN_STEPS)
        runs = {"tp2": dict(cfg={**TRAIN_CFG, "tensor_model_parallel_size": 2}, **common,
                            reference_dir=tiny_models["qwen3"],
                            variants={"sp": {"sequence_parallel": True}, "sdpa": SDPA,
                                      "sdpa_sp": {**SDPA, "sequence_parallel": True}}),
                "pp2": dict(cfg={**TRAIN_CFG, "pipeline_model_parallel_size": 2}, **common,
                            reference_dir=tiny_models["qwen2"]),
                "dp2_distopt": dict(cfg={**TRAIN_CFG, "use_distributed_optimizer": True}, **{**common, "model_dirs": {}},
                                    save_at=SAVE_AT, ckpt_root=str(folder / "ckpt"))}
        results = run_sequence(2, [("mg_scenarios:layout_run", kw) for kw in runs.values()], timeout=420 * len(runs))
        return {**dict(zip(runs, results)), "root": str(folder)}

    return shared_results.get("megatron_world2", make)
