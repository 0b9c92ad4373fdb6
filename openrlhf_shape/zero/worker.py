"""One DeepSpeed ZeRO rank of the actor: the same methods, inputs and outputs as
:class:`~openrlhf_shape.megatron.worker.MegatronRankWorker`, on a Hugging Face model.

SPMD like the Megatron ranks: every rank receives the whole batch and the same calls in the same
order; each takes its data-parallel shard (:func:`~openrlhf_shape.actor.batching.shard_for_dp`,
the same sharding and token-budget micro-batching as Megatron). ZeRO-3 gathers parameters inside
every forward, a collective, so every rank runs the same number of micro-batches (the shorter
plans are topped up with fully masked two-token fillers; every rank can compute every rank's plan).

One optimizer step: each micro-batch's backward is marked as inside (or, the last one, at) the
gradient-accumulation boundary, so DeepSpeed reduces gradients once, at the end; then
``engine.step()`` clips by the global norm and updates. The loss of a micro-batch is its token-loss
sum divided by the mini-batch's global valid-token count (all ranks), times the world size because
DeepSpeed averages gradients over all ranks: the result is the gradient of the global token mean.

Ring attention (``--ds.ring_attn_size``, :mod:`openrlhf_shape.zero.ring_attention`): groups of that many consecutive
ranks share one data-parallel shard; each packed micro-batch is cut into contiguous pieces, one per ring rank, whose
per-token results go back to every ring rank (:func:`~openrlhf_shape.actor.cp_comm.sum_over_cp`); each ring rank's
gradient then carries its piece's share, and the average over all ranks (x world size) sums them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.batch import SequenceBatch, TrainBatch, ValueBatch, length_mask
from openrlhf_shape.actor.batching import MicroBatch, micro_batch_budget, rank_micro_batches, validate_batch
from openrlhf_shape.actor.micro_batch_loss import METRIC_KEYS, micro_batch_loss, step_metrics
from openrlhf_shape.platform import Platform
from openrlhf_shape.rng import seed_all
from openrlhf_shape.zero.config import ZeroConfig
from openrlhf_shape.zero.state import ZeroState

__all__ = ["ZeroRankWorker"]


def set_cpu_accelerator(platform: Platform) -> None:
    """DeepSpeed picks its accelerator at import: under a CPU profile it must be told "cpu"."""
    if platform.on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def skip_cpu_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU communication backend from g++-compiling its shared-memory all-reduce op.

    On the CPU accelerator, starting DeepSpeed's process group builds ``deepspeed_shm_comm`` (g++, measured 57 s on a busy
    2-core machine; once per ``~/.cache/torch_extensions``, so on every fresh machine and CI run). Only DeepSpeed's
    ``inference_all_reduce`` uses that op; ZeRO training reduces through ``torch.distributed`` (gloo here) and
    never calls it, so marking the op incompatible changes no number and saves the compile."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ZeroRankWorker:
    """Owns one DeepSpeed rank (plain class; :class:`openrlhf_shape.cluster.rank_group.RankActor` hosts it in
    a Ray actor). Its engine, optimizer and counters live in one :class:`~openrlhf_shape.zero.state.ZeroState`,
    handed to the checkpoint and export functions (they never see the worker)."""

    def __init__(self, cfg: ZeroConfig, *, rank: int, world_size: int, master_addr: str, master_port: int,
                 platform: Platform | dict):
        """``platform``: the run's profile as handed by the driver (``openrlhf_shape/platform.py``); a rank
        without a driver passes ``detect_platform()`` of its own process."""
        self.platform = Platform.from_dict(platform)
        set_cpu_accelerator(self.platform)
        cfg = cfg.for_platform(self.platform)
        ring = cfg.ring_attn_size
        if world_size % ring:
            raise ValueError(f"--ds.ring_attn_size {ring} must divide the number of DeepSpeed ranks {world_size} "
                             "(--actor.num_nodes x --actor.num_gpus_per_node)")
        self.state = ZeroState(cfg=cfg, platform=self.platform, rank=rank, world_size=world_size,
                               dp_size=world_size // ring)
        self.rank, self.world_size = rank, world_size
        self.on_cpu = self.platform.on_cpu
        n_dev = 0 if self.on_cpu else torch.cuda.device_count()
        local_rank = int(os.environ.get("LOCAL_RANK", rank % n_dev if n_dev > 1 else 0))
        if not self.on_cpu:
            torch.cuda.set_device(local_rank)
        # DeepSpeed reads the rank layout from the environment (its launcher's variables).
        for key, value in (("LOCAL_RANK", local_rank), ("RANK", rank), ("WORLD_SIZE", world_size),
                           ("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port)):
            os.environ.setdefault(key, str(value))
        if not dist.is_initialized():
            dist.init_process_group(backend=self.platform.collective_backend,
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                    world_size=world_size, timeout=timedelta(minutes=30))
        import deepspeed

        if self.on_cpu:
            skip_cpu_shm_comm_op()
        # DeepSpeed's communication layer adopts the existing torch.distributed group.
        deepspeed.init_distributed(dist_backend=self.platform.collective_backend, auto_mpi_discovery=False)
        # OpenRLHF's mesh (dp, sp): ring groups of consecutive ranks, one data-parallel shard each
        self.dp_size, self.dp_rank, self.ring_rank = world_size // ring, rank // ring, rank % ring
        # every rank takes part in creating every group
        groups = [dist.new_group(ranks=list(range(d, d + ring))) for d in range(0, world_size, ring)] if ring > 1 else []
        self.ring_group = groups[rank // ring] if groups else None
        seed_all(cfg.optim.seed)
        from openrlhf_shape.actor.offload import StateOffloader

        self.offloader = StateOffloader(on_gpu=self.platform.on_gpu)

    # ------------------------------------------------------------------ properties
    @property
    def cfg(self) -> ZeroConfig:
        """The rank's settings, resolved for its profile; they live in the state checkpoint/export read."""
        return self.state.cfg

    @cfg.setter
    def cfg(self, cfg: ZeroConfig) -> None:  # a new configuration for the next init_model (tests run stages on one rank)
        self.state.cfg = cfg.for_platform(self.platform)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    @property
    def policy(self):
        return self.state.policy

    def _require_model(self) -> None:
        self.state.require_model()

    def _require_onloaded(self, groups: tuple[str, ...], what: str) -> None:
        missing = [g for g in groups if g in self.offloader.offloaded]
        if missing:
            raise RuntimeError(f"{what} while {', '.join(missing)} are offloaded to host; onload_states() first "
                               "(the colocation lifecycle orders this)")

    # ------------------------------------------------------------------ model
    def init_model(self, hf_dir: str, *, train: bool = True) -> dict:
        """Load the HF model, wrap it in a DeepSpeed engine (ZeRO stage, optimizer, offload).

        ``train`` is accepted for interface parity; the DeepSpeed engine always carries its optimizer."""
        import deepspeed
        from transformers import AutoConfig

        from openrlhf_shape.zero.model import PolicyModule, load_hf_model, register_head_weight

        cfg, o = self.cfg, self.cfg.optim
        self._release_engine()
        hf_config = AutoConfig.from_pretrained(hf_dir)
        hf = load_hf_model(hf_dir, dtype=cfg.params_dtype, attn_implementation=self._attention(hf_config),
                           gradient_checkpointing=o.gradient_checkpointing_enable)
        n_params = sum(p.numel() for p in hf.parameters())
        policy = PolicyModule(hf, o.entropy_chunk_size)
        optimizer = self._make_optimizer(policy)
        engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                               config=cfg.ds_config(on_gpu=not self.on_cpu),
                                               dist_init_required=False)
        if cfg.zero_stage == 3:
            register_head_weight(engine.module)
        self.state.engine, self.state.base_optimizer = engine, optimizer
        self.state.hf_config, self.state.hf_dir = hf_config, hf_dir
        self.state.step = 0
        self.state.apply_lr()
        return {
            "num_parameters": int(n_params),
            "model_type": hf_config.model_type,
            "tp": 1, "pp": 1, "dp": self.dp_size, "ring_attn_size": cfg.ring_attn_size,
            "zero_stage": cfg.zero_stage,
            "adam_offload": cfg.adam_offload,
            "dtype": str(cfg.params_dtype),
            "backend": "deepspeed",
        }

    def _attention(self, hf_config) -> str:
        """The HF attention implementation: ``--ds.attn_implementation``, or under ring attention ours
        (:mod:`openrlhf_shape.zero.ring_attention`), whose head stride must divide the KV heads."""
        cfg = self.cfg
        if cfg.ring_attn_size == 1:
            return cfg.attn_implementation
        from openrlhf_shape.zero import ring_attention

        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
        if kv_heads % cfg.ring_attn_head_stride:
            raise ValueError(f"--ds.ring_attn_head_stride {cfg.ring_attn_head_stride} must divide the model's "
                             f"num_key_value_heads={kv_heads} (KV heads are gathered that many at a time)")
        return ring_attention.register()

    def init_reference(self, hf_dir: str) -> dict:
        """The reference model: ``hf_dir``'s weights under a DeepSpeed engine without optimizer, partitioned as the
        actor's (ZeRO-3: every parameter over the ranks; stages 0-2, which shard only optimizer states and
        gradients: whole on every rank, as OpenRLHF's evaluation config does)."""
        import deepspeed
        from transformers import AutoConfig

        from openrlhf_shape.zero.model import PolicyModule, load_hf_model, register_head_weight

        cfg = self.cfg
        self._release_engine()
        hf_config = AutoConfig.from_pretrained(hf_dir)
        hf = load_hf_model(hf_dir, dtype=cfg.params_dtype, attn_implementation=self._attention(hf_config),
                           gradient_checkpointing=False)
        hf.requires_grad_(False)
        n_params = sum(p.numel() for p in hf.parameters())
        policy = PolicyModule(hf, cfg.optim.entropy_chunk_size)
        engine, _, _, _ = deepspeed.initialize(model=policy, config=cfg.ds_reference_config(), dist_init_required=False)
        if cfg.zero_stage == 3:
            register_head_weight(engine.module)
        self.state.engine, self.state.base_optimizer = engine, None
        self.state.hf_config, self.state.hf_dir, self.state.step = hf_config, hf_dir, 0
        local = sum(int(getattr(p, "ds_tensor", p).numel()) for p in engine.module.parameters())
        return {"num_parameters": int(n_params), "num_parameters_local": local, "model_type": hf_config.model_type,
                "tp": 1, "pp": 1, "dp": self.dp_size, "zero_stage": 3 if cfg.zero_stage == 3 else 0,
                "dtype": str(cfg.params_dtype), "backend": "deepspeed", "reference": True}

    def init_value_model(self, hf_dir: str, *, default_prefix: str | None = None, head_seed: int | None = None) -> dict:
        """A value model (reward model / critic in OpenRLHF's format, :mod:`openrlhf_shape.zero.value`), forward only,
        partitioned as the reference; ``head_seed`` draws a head for a directory without one (a causal LM). Its head is
        ``<prefix>.weight``: config.json's ``value_head_prefix``, else ``default_prefix``, else the rank config's
        (``--ds.value_head_prefix``)."""
        from openrlhf_shape.zero.value import init_value_engine

        if self.cfg.ring_attn_size > 1:
            raise ValueError("a value model does not run under --ds.ring_attn_size > 1 yet: set it to 1 for the "
                             "reward model / critic ranks")
        self._release_engine()
        return init_value_engine(self.state, hf_dir, self.cfg.attn_implementation,
                                 default_prefix=default_prefix or self.cfg.value_head_prefix, head_seed=head_seed)

    def compute_values(self, batch: SequenceBatch | dict) -> dict:
        """Forward only; ``{"indices", "values"}`` of this rank's shard (``{}`` without one): per sample of prompt P
        and response R its raw values ``[R + 1]`` float32 (index j < R: response token j's state; R: the whole
        sequence's, the reward model's score), un-normalised."""
        from openrlhf_shape.zero.value import value_outputs

        self._require_model()
        self._require_onloaded(("params",), "compute_values")
        shard, mbs = self._plans(validate_batch(batch), forward_only=True)
        out = value_outputs(self.state, mbs, self.device)
        return out if shard else {}

    def init_critic(self, hf_dir: str, optim: OptimConfig, value_clip: float | None = 0.5,
                    head_seed: int | None = None, *, default_prefix: str | None = None) -> dict:
        """The critic: ``hf_dir``'s value model, trainable with its own optimiser and LR schedule ``optim``
        (``TrainConfig.critic_optim_config()``); ``value_clip``: ``--critic.value_clip`` of :meth:`train_values`.
        Checkpoints and ``export_hf`` (OpenRLHF's value-model directory) then act on it."""
        from openrlhf_shape.zero.critic import init_critic_engine

        if self.cfg.ring_attn_size > 1:
            raise ValueError("a value model does not run under --ds.ring_attn_size > 1 yet: set it to 1 for the "
                             "critic ranks")
        self._release_engine()
        self.state.cfg = dataclasses.replace(self.state.cfg, optim=optim)
        self.value_clip = value_clip
        return init_critic_engine(self.state, hf_dir, self.cfg.attn_implementation, self._make_optimizer,
                                  on_gpu=not self.on_cpu, default_prefix=default_prefix or self.cfg.value_head_prefix,
                                  head_seed=head_seed)

    def train_values(self, batch: ValueBatch) -> dict:
        """One optimizer step of the critic over the whole mini-batch (``zero/critic.py``); float metrics under
        OpenRLHF's names, identical on every rank (the same keys as the Megatron backend's)."""
        from openrlhf_shape.zero.critic import critic_step

        self._require_model()
        self.state.require_optimizer("train_values")
        self._require_onloaded(("params", "grads", "optimizer"), "train_values")
        if self.state.value_format is None:
            raise RuntimeError("train_values needs a critic: init_critic(hf_dir, optim) first")
        batch.validate()
        _, mbs = self._plans(batch, forward_only=False)
        return critic_step(self.state, batch, mbs, value_clip=self.value_clip, device=self.device)

    def _make_optimizer(self, policy) -> torch.optim.Optimizer:
        """AdamW (decoupled weight decay, as Megatron's CPU/GPU Adam) with Megatron's grouping: no weight
        decay on biases and 1-D (norm) weights. ``DeepSpeedCPUAdam`` under ``--ds.adam_offload``."""
        adam = self.cfg.optim.adam
        decay, no_decay = [], []
        for name, p in policy.named_parameters():
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        groups = [g for g in ({"params": decay, "weight_decay": adam.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        kw = dict(lr=adam.lr, betas=tuple(adam.betas), eps=adam.eps)
        if self.cfg.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            from openrlhf_shape.platform import torch_extensions_dir

            # cpu_adam is JIT-built for this CPU (-march=native): a cache of its own per instruction set
            os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
        return torch.optim.AdamW(groups, **kw)

    def _release_engine(self) -> None:
        self.state.value_format = None  # the next engine is a policy unless init_value_model says otherwise
        if self.state.engine is not None:
            self.offloader.saved.clear()
            self.state.engine.destroy()
            self.state.engine = self.state.base_optimizer = None

    # ------------------------------------------------------------------ micro-batching
    def _plans(self, batch: SequenceBatch, *, forward_only: bool) -> tuple[list[int], list[MicroBatch]]:
        """This rank's sample indices and micro-batches, topped up with fillers to the longest plan (ZeRO-3's
        parameter gathers are collectives). Packed into one row each (position-id packing: the HF model's
        attention masks each sample to itself) where the attention implementation supports it
        (:func:`~openrlhf_shape.zero.model.packs_samples`), under ``--rollout.max_tokens_per_gpu`` for a
        forward-only pass."""
        from openrlhf_shape.zero.model import packs_samples

        optim, ring = self.cfg.optim, self.cfg.ring_attn_size
        return rank_micro_batches(
            batch, dp_size=self.dp_size, dp_rank=self.dp_rank,
            # ring attention: always packed, the pack cut into ring-size pieces; the budget is per GPU (OpenRLHF's)
            max_tokens=ring * micro_batch_budget(optim, forward_only=forward_only),
            packed=ring > 1 or (optim.pack_samples and packs_samples(self.cfg.attn_implementation)),
            pad_id=int(getattr(self.state.hf_config, "pad_token_id", None) or 0), pad_multiple=ring,
            equal_counts=True)

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-prob ``[N]``, entropy ``[N]``) of ``mb``'s responses; under ring attention this rank runs its piece
        (inside :meth:`_micro_batch`) and every ring rank gets all N back."""
        dev = self.device
        if self.cfg.ring_attn_size == 1:
            return self.state.engine(mb.input_ids.to(dev), mb.position_ids.to(dev), mb.resp_rows.to(dev),
                                     mb.resp_pos.to(dev), mb.resp_targets.to(dev))
        from openrlhf_shape.actor.cp_comm import sum_over_cp

        start, end = self._piece(mb)
        held = (mb.resp_pos >= start) & (mb.resp_pos < end)
        lp, en = self.state.engine(mb.input_ids[:, start:end].to(dev), mb.position_ids[:, start:end].to(dev),
                                   mb.resp_rows[held].to(dev), (mb.resp_pos[held] - start).to(dev),
                                   mb.resp_targets[held].to(dev))
        held = held.to(dev)
        return sum_over_cp(lp, held, self.ring_group), sum_over_cp(en, held, self.ring_group)

    def _piece(self, mb: MicroBatch) -> tuple[int, int]:
        """``[start, end)``: this ring rank's contiguous piece of a packed micro-batch."""
        length = int(mb.input_ids.shape[1]) // self.cfg.ring_attn_size
        return self.ring_rank * length, (self.ring_rank + 1) * length

    def _micro_batch(self, mb: MicroBatch):
        """The context of one micro-batch's forward and backward (a recompute under gradient checkpointing runs
        the attention again): under ring attention, the layout the attention function reads."""
        if self.cfg.ring_attn_size == 1:
            return contextlib.nullcontext()
        from openrlhf_shape.zero.ring_attention import RingLayout, ring_layout

        lengths = torch.tensor([b - a for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])])
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(self.device)
        return ring_layout(RingLayout(doc=doc, start=self._piece(mb)[0], group=self.ring_group,
                                      head_stride=self.cfg.ring_attn_head_stride))

    # ------------------------------------------------------------------ log-probs / entropy
    def compute_logprobs_and_entropy(self, batch: SequenceBatch | dict) -> dict:
        """Forward only; ``{"indices", "log_probs", "entropy"}`` of this rank's shard (``{}`` without one).

        Position j of a sample's tensors is response token j: log-prob and full-vocab entropy of
        ``logits / temperature`` in float32 (see :mod:`openrlhf_shape.zero.model`). ``"micro_batches"``: how many
        forward micro-batches of at most ``optim.forward_budget`` tokens (``--rollout.max_tokens_per_gpu``) it took."""
        self._require_model()
        self._require_onloaded(("params",), "compute_logprobs_and_entropy")
        batch = validate_batch(batch)
        self.policy.head.inv_temperature = 1.0 / float(batch.temperature)
        shard, mbs = self._plans(batch, forward_only=True)
        out: dict[str, Any] = {"indices": [], "log_probs": [], "entropy": [], "micro_batches": len(mbs)}
        self.state.engine.eval()
        with torch.no_grad():
            for mb in mbs:
                with self._micro_batch(mb):
                    lp, en = self._forward(mb)
                lp, en = lp.float().cpu(), en.float().cpu()
                for row, (a, b) in zip(mb.rows, mb.resp_offsets):
                    out["indices"].append(row)
                    out["log_probs"].append(lp[a:b].clone())
                    out["entropy"].append(en[a:b].clone())
        self.state.engine.train()
        return out if shard and self.ring_rank == 0 else {}  # ring peers hold the same results: one reports

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer step over the whole mini-batch; float metrics identical on every rank
        (the same keys as the Megatron backend's ``train_step``)."""
        self._require_model()
        self.state.require_optimizer("train_step")
        self._require_onloaded(("params", "grads", "optimizer"), "train_step")
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"train_step needs an openrlhf_shape.batch.TrainBatch, got {type(batch).__name__}")
        batch.validate()
        lr_used = self.state.apply_lr()
        sums = self._accumulate_gradients(batch)
        self.state.engine.step()
        sums = sums.to(self.device)  # NCCL reduces device tensors only (gloo: this is the CPU already)
        dist.all_reduce(sums)
        sums = sums.cpu()
        # DeepSpeed skips the update itself when the global gradient norm is not finite (a non-finite
        # loss gives non-finite gradients): the step counter and the LR schedule then stay put.
        overflow = bool(getattr(self.state.engine.optimizer, "overflow", False))
        norm = self.state.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        ok = not overflow and math.isfinite(grad_norm)
        if ok:
            self.state.step += 1
        return step_metrics(sums, grad_norm=grad_norm, lr=lr_used, ok=ok, step=self.state.step)

    def _accumulate_gradients(self, batch: TrainBatch) -> torch.Tensor:
        """Forward and backward of every micro-batch of this rank (gradients reduced at the last one, the
        accumulation boundary); returns this rank's metric sums ``[len(METRIC_KEYS)]`` float64."""
        masks = batch.loss_mask.bool() & length_mask(batch.response_lens, batch.loss_mask.shape[1])
        num_global_tokens = max(int(masks.sum()), 1)
        num_global_samples = max(int(masks.any(-1).sum()), 1)  # gspo's sample-level denominator
        self.policy.head.inv_temperature = 1.0 / float(batch.temperature)
        shard, mbs = self._plans(batch, forward_only=False)
        optim = self.cfg.optim
        eps_low, eps_high = optim.policy_clip_low_high
        sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64)
        self.state.engine.train()
        for k, mb in enumerate(mbs):
            self.state.engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
            with self._micro_batch(mb):
                lp, en = self._forward(mb)
                loss, stats = micro_batch_loss(lp, en, mb, batch, masks, num_global_tokens, eps_low=eps_low,
                                               eps_high=eps_high, dual_clip=optim.dual_clip,
                                               loss_type=optim.policy_loss_type, num_global_samples=num_global_samples)
                for j, key in enumerate(METRIC_KEYS):
                    sums[j] += float(stats[key]) if self.ring_rank == 0 else 0.0  # ring peers: the same stats
                # DeepSpeed averages gradients over all ranks (DP x ring); the loss is already a global token mean,
                # and each ring rank's gradient carries its own piece's share (the group's sum is the whole).
                self.state.engine.backward(loss * self.world_size)
        return sums

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str, extra: Optional[dict] = None) -> None:
        """Atomically write model + optimizer + schedule step + RNG (+ ``extra``) to ``ckpt_dir``."""
        from openrlhf_shape.zero.checkpoint import save_checkpoint

        self._require_model()
        self.state.require_optimizer("save_checkpoint")
        self._require_onloaded(("params", "grads", "optimizer"), "save_checkpoint")
        save_checkpoint(self.state, ckpt_dir, extra or {})

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore everything :meth:`save_checkpoint` wrote; returns its ``extra``."""
        from openrlhf_shape.zero.checkpoint import load_checkpoint

        self._require_model()
        self.state.require_optimizer("load_checkpoint")
        return load_checkpoint(self.state, ckpt_dir)

    # ------------------------------------------------------------------ weights out
    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights in buckets of at most ``bucket_bytes`` (a bigger tensor: its own).

        All ranks iterate in lockstep (ZeRO-3 gathers each bucket's parameters, a collective); rank 0
        yields detached CPU copies, the others ``[]`` at the same points."""
        from openrlhf_shape.zero.export import iter_buckets

        self._require_model()
        self._require_onloaded(("params",), "iter_hf_weights")
        yield from iter_buckets(self.state, bucket_bytes)

    def export_hf(self, out_dir: str) -> None:
        """Write an HF directory (safetensors + config + tokenizer files) atomically to ``out_dir``."""
        from openrlhf_shape.zero.export import export_hf_dir

        self._require_model()
        export_hf_dir(self.state, out_dir)

    # ------------------------------------------------------------------ colocation
    def offload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        """Move parameter / gradient / optimizer storages to host memory (colocation)."""
        from openrlhf_shape.zero.offload import state_tensors

        self._require_model()
        freed = self.offloader.offload(state_tensors(self.state.engine), groups)
        return {"offloaded_bytes": float(freed), "offloaded": sorted(self.offloader.offloaded)}

    def onload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        """Bring offloaded groups back (bit for bit)."""
        self._require_model()
        restored = self.offloader.onload(groups)
        return {"onloaded_bytes": float(restored), "offloaded": sorted(self.offloader.offloaded)}

    # ------------------------------------------------------------------ teardown
    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        """Drop the engine and the process group (idempotent)."""
        try:
            if self.state.engine is not None:
                self.offloader.onload()
                self._release_engine()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


