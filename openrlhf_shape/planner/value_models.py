"""Value models in the dry-run plan: the critic of ``--algo.advantage.estimator gae`` (trained beside the actor) and a
reward model (forward only), and the check that a model directory holds a value head in OpenRLHF's format.

Both are the policy's architecture with a ``[1, hidden]`` value head in place of the LM head (OpenRLHF's
``get_llm_for_sequence_regression``), on ranks of their own in the actor's backend and TP/PP layout. Memory per
GPU is the actor's formulas (planner/memory.py, planner/zero_memory.py) on their rank count: the critic holds
weights, gradients and Adam state and the activations of its training micro-batch (its ``update`` phase) or of
its forward (its ``values`` phase); a reward model only weights and the forward's activations. The LM head's
parameters are counted as the policy's (an overestimate by ``vocab x hidden / TP`` on the last stage when the
embeddings are untied), and the log-prob scratch is not (a value head has no vocabulary). Time: the critic's
forward over every token (its values, when the batch is made) and its update (forward and backward per epoch),
each over its own GPUs; a reward model's forward over every sequence (and the probes' when it judges them), in the
rewards' place of the step, plus its weights' trips over PCIe when they live on host between forwards.
"""

from __future__ import annotations

import json
import os
import struct

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import Phase, flops_per_token
from openrlhf_shape.planner.memory import MegatronMemory, Term, megatron_memory_stages
from openrlhf_shape.planner.model import ModelShape

VALUE_HEAD_PREFIX = "score"  # --ds.value_head_prefix's default, OpenRLHF's (a config.json "value_head_prefix" wins)


def value_model_memory(model: ModelShape, cfg, *, world: int, micro_batch_tokens: int, max_seq: int, dtype: str,
                       spec: str, train: bool, label: str) -> list[MegatronMemory]:
    """One rank of a value model per PP stage: ``train`` (the critic's update: weights, grads, Adam, activations) or
    forward only (weights and activations); every term named ``"<label> <term>"``."""
    tp, pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size
    dp, seq = max(1, world // (tp * pp)), min(micro_batch_tokens, max_seq)
    if cfg.actor.backend == "deepspeed" and not model.is_moe:
        from openrlhf_shape.planner.zero_memory import zero_memory

        stage = cfg.ds.zero_stage if train else (3 if cfg.ds.zero_stage == 3 else 0)
        mems = [zero_memory(model, dp=dp, stage=stage, micro_batch_tokens=micro_batch_tokens, seq_len=seq,
                            recompute="none", dtype=dtype, logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec,
                            forward_only=not train)]
        if not train:
            mems[0].static = [t for t in mems[0].static if t.name == "weights"]
    else:
        kw = dict(tp=tp, pp=pp, dp=dp, micro_batch_tokens=micro_batch_tokens, seq_len=seq, recompute="none",
                  sequence_parallel=bool(cfg.megatron.sequence_parallel and tp > 1), dtype=dtype,
                  distributed_optimizer=cfg.megatron.use_distributed_optimizer,
                  logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec, forward_only=not train, with_optimizer=train)
        if model.is_moe:
            ep = int(cfg.megatron.expert_model_parallel_size)
            kw.update(ep=ep if (tp * dp) % ep == 0 else 1)
        mems = megatron_memory_stages(model, **kw)
    return [_relabel(m, label) for m in mems]


def _relabel(mem: MegatronMemory, label: str) -> MegatronMemory:
    """The terms named for the model that holds them, without the log-prob scratch (a value head has no vocabulary)."""
    name = lambda ts: [Term(f"{label} {t.name}", t.bytes, t.formula) for t in ts if "log-prob" not in t.name]  # noqa: E731
    return MegatronMemory(mem.stage, name(mem.static), name(mem.stored), name(mem.transient), name(mem.step), mem.n_local)


def critic_time(model: ModelShape, *, world: int, total_tokens: float, seq: float, epochs: int, recompute: bool,
                overlap: dict[str, float] | None, opt: PlanOptions) -> list[Phase]:
    """The critic's two phases of a step over its ``world`` GPUs: ``critic values`` (one forward of every token, in
    the log-probs' place of the schedule) and ``critic update`` (forward and backward per epoch, in the update's).
    ``overlap``: the actor's seconds of those two places when the critic has GPUs of its own (OpenRLHF dispatches
    both models at once: the step waits only for the critic's excess); None when it shares the actor's (serial)."""
    gpu_flops = opt.peak_tflops * 1e12 * opt.mfu
    f_fwd = flops_per_token(model, seq, backward=False, recompute=False)
    f_tr = flops_per_token(model, seq, backward=True, recompute=recompute)
    rate = f"/ ({world} GPUs x {opt.peak_tflops:g} TFLOPS x MFU {opt.mfu})"
    out = []
    for name, place, t, how in (
            ("critic values", "log-probs + entropy", total_tokens * f_fwd / (world * gpu_flops),
             f"{total_tokens:,.0f} tokens x {f_fwd / 1e9:.1f} GFLOP/token {rate}"),
            ("critic update", "update", epochs * total_tokens * f_tr / (world * gpu_flops),
             f"{epochs} epoch(s) x {total_tokens:,.0f} tokens x {f_tr / 1e9:.1f} GFLOP/token {rate}")):
        if overlap is not None:  # alongside the actor's phase: only what outlasts it
            t, how = max(0.0, t - overlap[place]), f"max(0, {how} - the actor's {overlap[place]:.1f} s, run alongside)"
        out.append(Phase(name, t, how, parts=((place, t),)))
    return out


def reward_model_time(model: ModelShape, *, world: int, total_tokens: float, seq: float, opt: PlanOptions,
                      moved_bytes: int = 0) -> Phase:
    """A reward model's forward of every sequence over its ``world`` GPUs, and ``moved_bytes`` (one rank's weights,
    kept on host outside the forward: colocated or ``--reward.offload``) to the GPU and back over PCIe; in the
    rewards' place of the one-step-off schedule."""
    f = flops_per_token(model, seq, backward=False, recompute=False)
    t = total_tokens * f / (world * opt.peak_tflops * 1e12 * opt.mfu) + 2 * moved_bytes / (opt.pcie_gbs * 1e9)
    how = (f"{total_tokens:,.0f} tokens x {f / 1e9:.1f} GFLOP/token / ({world} GPUs x {opt.peak_tflops:g} TFLOPS x "
           f"MFU {opt.mfu})" + (f" + weights on and off the GPU 2 x {moved_bytes / 1e9:.2f} GB at {opt.pcie_gbs:g} GB/s"
                                if moved_bytes else ""))
    return Phase("reward model", t, how, parts=(("rewards", t),))


def value_head_problem(path: str, prefix: str = VALUE_HEAD_PREFIX, *, normalize: bool = False) -> str | None:
    """None when ``path`` is a model directory whose weights hold OpenRLHF's value head (``<prefix>.weight`` of shape
    ``[1, hidden_size]``; config.json's ``value_head_prefix`` overrides ``prefix`` (``--ds.value_head_prefix``), as
    OpenRLHF reads it) and, with ``normalize`` (``--reward.normalize_enable``), whose config.json holds the reward
    ``mean`` and a positive ``std`` (without them the flag would do nothing); else what is wrong, in one line. Reads the safetensors headers (one file or an
    index) or a ``pytorch_model.bin``."""
    conf = os.path.join(path, "config.json")
    if not os.path.isfile(conf):
        return f"{path} is not a Hugging Face model directory (no config.json)"
    with open(conf) as f:
        config = json.load(f)
    named, prefix = "value_head_prefix" in config, config.get("value_head_prefix", prefix)
    shapes = _tensor_shapes(path)
    if shapes is None:
        return f"{path} has no weights (model.safetensors, its index, or pytorch_model.bin)"
    key, want = f"{prefix}.weight", [1, config.get("hidden_size")]
    if key not in shapes:
        heads = sorted(k[:-len(".weight")] for k, v in shapes.items() if k.count(".") == 1 and list(v) == want)
        fix = (f"; its config.json names the head {prefix}" if named else
               f"; a [1, hidden] head is stored as {', '.join(heads)}: set --ds.value_head_prefix to it" if heads else
               "; a policy checkpoint is not a value model")
        return (f"{path} has no value head: no tensor {key} (OpenRLHF's critic / reward-model format: the base model "
                f"and a Linear(hidden, 1) named {prefix}, --ds.value_head_prefix){fix}")
    if list(shapes[key]) != want:
        return f"{path}: the value head {key} has shape {list(shapes[key])}, not [1, hidden_size] = {want}"
    mean, std = config.get("mean"), config.get("std")
    if normalize and mean is None:  # OpenRLHF then divides by its defaults, mean 0 and std 1: the flag does nothing
        return (f"{path}: --reward.normalize_enable normalises by config.json's reward mean / std, which it has not "
                "(OpenRLHF's reward-model training writes them), so the scores would stay as they are: drop the flag "
                "or give a reward model that has them")
    if normalize and not (isinstance(std, (int, float)) and std > 0):
        return f"{path}: --reward.normalize_enable divides by config.json's std, which is {std!r}, not a positive number"
    return None


def _tensor_shapes(path: str) -> dict[str, list[int]] | None:
    """Tensor name -> shape of a model directory's weights, without loading them; None when it has none."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        import torch

        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="meta", weights_only=True)
        return {k: list(v.shape) for k, v in state.items()}
    else:
        return None
    shapes: dict[str, list[int]] = {}
    for name in files:
        with open(os.path.join(path, name), "rb") as f:  # safetensors: u64 header length, then a JSON header
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes
