"""One Megatron rank of the actor: model, optimizer, log-probs/entropy, train step, checkpoints, export.

SPMD: every rank of the job receives the same calls in the same order with the same arguments
(the whole batch); each rank takes its own data-parallel shard. CPU or GPU comes from the platform
profile handed to the rank (``openrlhf_shape/platform.py``): under a CPU profile the CPU patches
(:mod:`openrlhf_shape.megatron.cpu`) are applied and every public method runs inside the
CUDA->CPU device mode; under a GPU profile nothing of that is active and the only differences are
the layer spec (transformer-engine), the dtype (bf16) and the backend (NCCL).

The rank's model, optimizer, schedule and counters live in one :class:`~openrlhf_shape.megatron.state.ActorState`
that the worker hands to the checkpoint and export functions (they never see the worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from openrlhf_shape.batch import SequenceBatch, TrainBatch, length_mask
from openrlhf_shape.megatron import cpu as cpu_compat
from openrlhf_shape.megatron.attention import packed_seq_params, varlen_kernel
from openrlhf_shape.actor.cp_split import CpShard, cp_shard
from openrlhf_shape.actor.cp_comm import sum_over_cp
from openrlhf_shape.actor.batching import MicroBatch, micro_batch_budget, rank_micro_batches, validate_batch
from openrlhf_shape.actor.micro_batch_loss import METRIC_KEYS, micro_batch_loss, step_metrics
from openrlhf_shape.checkpoint_dir import latest_checkpoint  # noqa: F401  (re-exported: module-level API of the worker)
from openrlhf_shape.megatron.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.export import export_hf_dir, iter_buckets
from openrlhf_shape.megatron.pad_embedding import detach_pad_lookups
from openrlhf_shape.megatron.routing_replay import MicroBatchRouting, RoutingReplay
from openrlhf_shape.actor.logprobs import vocab_parallel_logprobs_entropy
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.platform import Platform
from openrlhf_shape.rng import seed_all

__all__ = ["MegatronRankWorker", "latest_checkpoint"]


@contextlib.contextmanager
def _hidden_states_only(gpt) -> Iterator[None]:
    """Make GPTModel.forward stop after the final norm (we apply the output layer in chunks)."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


class _State:
    """A worker attribute that lives in its :class:`ActorState` (``worker.model`` is ``worker.state.model``)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.state, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj.state, self.name, value)


class MegatronRankWorker:
    """Owns one Megatron rank (plain class; :class:`openrlhf_shape.cluster.rank_group.RankActor` hosts it).

    ``platform``: the run's profile as handed by the driver (a :class:`Platform` or its dict). A rank
    without a driver (the subprocess ranks of ``actor/launch.py``, ``convert``) passes
    ``detect_platform()`` of its own process: the caller decides, never the worker.
    """

    cfg = _State()
    dp_size = _State()
    model = _State()
    optimizer = _State()
    scheduler = _State()
    bridge = _State()
    tconfig = _State()
    hf_config = _State()
    hf_dir = _State()
    step = _State()

    def __init__(self, cfg: MegatronConfig, *, rank: int, world_size: int, master_addr: str, master_port: int,
                 platform: Platform | dict):
        self.platform = Platform.from_dict(platform)
        self.rank = rank
        self.world_size = world_size
        self.on_cpu = self.platform.on_cpu
        cfg.check_device(self.platform)
        cfg = cfg.for_platform(self.platform)
        self.state = ActorState(cfg=cfg, platform=self.platform, rank=rank, world_size=world_size,
                                dp_size=cfg.data_parallel_size(world_size))
        self.routing: RoutingReplay | None = None  # MoE routing replay (--megatron.routing_replay), set by init_model
        cpu_compat.apply_cpu_patches(self.platform)  # on GPU only the no-transformer-engine MoE router patch
        if not self.on_cpu:
            n_dev = torch.cuda.device_count()
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(n_dev, 1))) if n_dev > 1 else 0)
        with self._mode():
            if not dist.is_initialized():
                dist.init_process_group(
                    backend=self.platform.collective_backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(minutes=30),
                )
            from megatron.core import parallel_state as mpu
            from megatron.core import tensor_parallel

            mpu.initialize_model_parallel(
                tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                context_parallel_size=cfg.context_parallel_size,
                expert_model_parallel_size=cfg.expert_model_parallel_size,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,  # None: the TP size (megatron's default)
            )
            seed_all(cfg.optim.seed)
            tensor_parallel.model_parallel_cuda_manual_seed(cfg.optim.seed)
        self.mpu = mpu
        from openrlhf_shape.actor.offload import StateOffloader

        self.offloader = StateOffloader(on_gpu=self.platform.on_gpu)

    # ------------------------------------------------------------------ helpers
    def _mode(self):
        return cpu_compat.cpu_device_mode() if self.on_cpu else contextlib.nullcontext()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    def _gpt(self):
        return _unwrap(self.model)

    def _require_onloaded(self, groups: tuple[str, ...], what: str) -> None:
        """Colocation guard: ``what`` needs these state groups in device memory."""
        missing = [g for g in groups if g in self.offloader.offloaded]
        if missing:
            raise RuntimeError(f"{what} while {', '.join(missing)} are offloaded to host; onload_states() first "
                               "(the colocation lifecycle orders this)")

    def offload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        """Move parameter / gradient / optimizer storages to host memory (colocation)."""
        self._require_model()
        from openrlhf_shape.megatron.offload import state_tensors

        freed = self.offloader.offload(state_tensors([self.model], self.optimizer), groups)
        return {"offloaded_bytes": float(freed), "offloaded": sorted(self.offloader.offloaded)}

    def onload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        """Bring offloaded groups back (bit for bit)."""
        self._require_model()
        restored = self.offloader.onload(groups)
        return {"onloaded_bytes": float(restored), "offloaded": sorted(self.offloader.offloaded)}

    def _require_model(self) -> None:
        self.state.require_model()

    def _require_optimizer(self, what: str) -> None:
        self.state.require_optimizer(what)

    @property
    def is_last_stage(self) -> bool:
        return self.mpu.is_pipeline_last_stage()

    @property
    def holds_results(self) -> bool:
        """The last stage's first TP and CP rank (CP ranks end with the same per-sample results: one reports)."""
        return (self.is_last_stage and self.mpu.get_tensor_model_parallel_rank() == 0
                and self.mpu.get_context_parallel_rank() == 0)

    def _cp_view(self, mb: MicroBatch) -> CpShard | None:
        """This CP rank's positions of ``mb`` (None without context parallelism)."""
        cp = self.cfg.context_parallel_size
        return cp_shard(mb, cp, self.mpu.get_context_parallel_rank()) if cp > 1 else None

    # ------------------------------------------------------------------ model
    def init_model(self, hf_dir: str, *, load_weights: bool = True, train: bool = True) -> dict:
        """Build the GPT model through the bridge, load HF weights, build optimizer + LR schedule.

        ``load_weights=False`` keeps Megatron's random initialisation (benchmarks: only the
        shapes of ``hf_dir``'s config matter). ``train=False`` builds a forward-only model: no
        DDP gradient buffers, no optimizer or schedule (``train_step`` and checkpoints refuse).
        """
        from transformers import AutoConfig

        from openrlhf_shape.megatron.bridge import make_bridge

        cfg = self.cfg
        hf_config = AutoConfig.from_pretrained(hf_dir)
        cfg.validate_against_model(hf_config, self.world_size)
        with self._mode():
            from megatron.core.transformer.module import Float16Module

            bridge = make_bridge(hf_config, cfg, platform=self.platform)
            gpt = self._build_gpt(bridge, hf_dir, load_weights)
            self.routing = None if cfg.routing_replay == "none" else RoutingReplay(gpt, sequence_parallel=cfg.sequence_parallel)
            tconfig = bridge.config
            module = Float16Module(tconfig, gpt) if cfg.use_bf16 else gpt
            if not train:
                for p in module.parameters():
                    p.requires_grad_(False)
                self.bridge, self.hf_config, self.hf_dir = bridge, hf_config, hf_dir
                self.model, self.optimizer, self.scheduler = module, None, None
                self.tconfig = tconfig
                return self._model_info(gpt)
            model = _wrap_ddp(module, tconfig, cfg)
            optimizer, scheduler = _build_optimizer(model, cfg)
        self.bridge, self.hf_config, self.hf_dir = bridge, hf_config, hf_dir
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.tconfig = tconfig
        return self._model_info(gpt)

    def init_reference(self, hf_dir: str) -> dict:
        """The reference model: ``hf_dir``'s weights in this rank's layout, forward only (no DDP buffers, no optimizer;
        free MoE routing: OpenRLHF's reference replays no rollout routing)."""
        self.cfg = dataclasses.replace(self.cfg, routing_replay="none")
        return {**self.init_model(hf_dir, train=False), "reference": True}

    def _build_gpt(self, bridge, hf_dir: str, load_weights: bool):
        """This rank's GPT stage from the bridge's provider, on its device, with HF weights when asked."""
        from megatron.core import tensor_parallel

        provider = bridge._model_provider([])
        gpt = provider(pre_process=self.mpu.is_pipeline_first_stage(), post_process=self.is_last_stage)
        detach_pad_lookups(gpt, getattr(bridge.hf_config, "pad_token_id", None))
        for p in gpt.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if not self.on_cpu:
            gpt.cuda(torch.cuda.current_device())
        if load_weights:
            bridge.load_weights([gpt], hf_dir)
        return gpt

    def _model_info(self, gpt) -> dict:
        cfg, hf_config = self.cfg, self.hf_config
        n_local = sum(p.numel() for p in gpt.parameters())
        # Each parameter once: dense ones from data-parallel rank 0, and of those replicated over the TP group (norms,
        # the router) TP rank 0's only; experts (``allreduce=False``: sharded over the expert-parallel and expert-TP
        # ranks, replicated over the expert-data-parallel group) from expert-DP rank 0.
        n_expert = sum(p.numel() for p in gpt.parameters() if not getattr(p, "allreduce", True))
        n_tp_replicated = sum(p.numel() for p in gpt.parameters()
                              if getattr(p, "allreduce", True) and not getattr(p, "tensor_model_parallel", False))
        dense = n_local - n_expert - (n_tp_replicated if self.mpu.get_tensor_model_parallel_rank() else 0)
        count = (dense if self.mpu.get_data_parallel_rank(with_context_parallel=True) == 0 else 0) + (
            n_expert if self.mpu.get_expert_data_parallel_rank() == 0 else 0)
        totals = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(totals)
        return {
            "num_parameters": int(totals.item()),
            "num_parameters_local": int(n_local),
            "model_type": hf_config.model_type,
            "tp": cfg.tensor_model_parallel_size,
            "pp": cfg.pipeline_model_parallel_size,
            "cp": cfg.context_parallel_size,
            "dp": self.dp_size,
            "dtype": str(cfg.params_dtype),
            **self._moe_info(),
        }

    def _moe_info(self) -> dict:
        """What Megatron's TransformerConfig says about experts and router losses ({} for a dense model)."""
        tc = self.tconfig
        if not getattr(tc, "num_moe_experts", None):
            return {}
        return {"moe": {"num_experts": int(tc.num_moe_experts), "ep": self.cfg.expert_model_parallel_size,
                        # what reached megatron-core: its expert groups (parallel_state) and TransformerConfig
                        "etp": self.mpu.get_expert_tensor_parallel_world_size(),
                        "ep_group": self.mpu.get_expert_model_parallel_world_size(),
                        "config_etp": tc.expert_tensor_parallel_size, "router_fusion": tc.moe_router_fusion,
                        "token_dispatcher": tc.moe_token_dispatcher_type,
                        "load_balancing": tc.moe_router_load_balancing_type,
                        "aux_loss_coeff": tc.moe_aux_loss_coeff, "z_loss_coeff": tc.moe_z_loss_coeff}}

    # ------------------------------------------------------------------ micro-batching
    def _plan(self, batch: SequenceBatch, *, forward_only: bool) -> tuple[list[int], list[MicroBatch]]:
        """This DP rank's sample indices and its micro-batches (same on TP/PP peers): packed into one THD row
        each (every attention of this backend takes them: ``megatron/attention.py``, TE) unless
        ``optim.pack_samples`` is off, under ``--rollout.max_tokens_per_gpu`` for a forward-only pass. With expert
        parallelism every MoE layer's forward and backward is an all-to-all over the data-parallel ranks of the
        expert group, so all DP ranks run as many micro-batches as the longest plan. Context parallelism: each
        sequence padded to :attr:`MegatronConfig.sequence_multiple`, and a micro-batch holds CP x the per-GPU budget
        (each CP rank computes 1/CP of it)."""
        cfg, optim = self.cfg, self.cfg.optim
        cp = cfg.context_parallel_size
        return rank_micro_batches(
            batch, dp_size=self.dp_size, dp_rank=self.mpu.get_data_parallel_rank(),
            max_tokens=cp * micro_batch_budget(optim, forward_only=forward_only), packed=optim.pack_samples,
            pad_id=int(getattr(self.hf_config, "pad_token_id", None) or 0),
            # sequence parallel splits the sequence dimension over the TP ranks, CP each sequence into 2 x CP chunks
            pad_multiple=cfg.pack_multiple if optim.pack_samples else max(cfg.sequence_multiple, cfg.pack_multiple),
            doc_multiple=cfg.sequence_multiple, equal_counts=cfg.expert_model_parallel_size > 1)

    def _response_logprobs(self, hidden: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool):
        """hidden [s(/tp under SP)(/cp), b, h] on the last stage -> (logp [N], entropy [N]) for mb's responses.
        Under CP each rank computes its own positions' and :func:`sum_over_cp` hands every CP rank all N."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        gpt = self._gpt()
        if self.cfg.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden)
        view = self._cp_view(mb)
        pos, rows, targets = ((mb.resp_pos, mb.resp_rows, mb.resp_targets) if view is None else
                              (view.resp_pos, view.resp_rows, mb.resp_targets[view.resp_local]))
        h = hidden[pos.to(hidden.device), rows.to(hidden.device)]  # [N, h] (under CP: [n] of this rank's)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        vocab_start = self.mpu.get_tensor_model_parallel_rank() * weight.shape[0]
        lp, en = vocab_parallel_logprobs_entropy(
            h,
            weight,
            targets.to(hidden.device),
            vocab_start=vocab_start,
            temperature=temperature,
            tp_group=self.mpu.get_tensor_model_parallel_group(),
            chunk_size=self.cfg.optim.entropy_chunk_size,
            with_entropy=with_entropy,
        )
        if view is None:
            return lp, en
        group, held = self.mpu.get_context_parallel_group(), view.resp_local.to(hidden.device)
        return sum_over_cp(lp, held, group), (sum_over_cp(en, held, group) if en is not None else None)

    def _run_schedule(self, mbs: list[MicroBatch], loss_fn, *, forward_only: bool,
                      routing: MicroBatchRouting | None = None) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        gpt = self._gpt()
        masked = self._router_losses_on() and not forward_only
        kernel = varlen_kernel(self.platform)  # flash-attn's varlen kernel only under a GPU profile

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, pos, extra = self._rank_inputs(mb, kernel, router_mask=masked)
            if routing is not None:
                routing.before(mb)
            with _hidden_states_only(gpt):
                out = model(ids, pos, None, **extra)
            if routing is not None:
                routing.after(mb)
            return out, functools.partial(loss_fn, mb)

        max_len = max(mb.input_ids.shape[1] for mb in mbs)
        fb = get_forward_backward_func()
        with self._router_loss_scale(mbs, forward_only=forward_only):
            return fb(
                forward_step_func=forward_step,
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=len(mbs),
                seq_length=max_len,
                micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
                forward_only=forward_only,
            )

    def _rank_inputs(self, mb: MicroBatch, kernel: str, *, router_mask: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(input ids, position ids, keyword arguments) of ``mb`` for this rank's model call: under CP the rank's
        chunks of every sequence; THD ``packed_seq_params`` (global document bounds) for a packed micro-batch; the
        router's padding mask when router losses are on (pads and fillers stay out of them)."""
        device, view = self.device, self._cp_view(mb)
        ids, pos = mb.input_ids, mb.position_ids
        extra: dict[str, Any] = {}
        if router_mask:
            extra["padding_mask"] = _router_padding_mask(mb)
        if view is not None:
            ids, pos = ids[:, view.index], pos[:, view.index]
            extra = {k: v[:, view.index] for k, v in extra.items()}
        extra = {k: v.to(device) for k, v in extra.items()}
        if mb.packed:
            extra["packed_seq_params"] = packed_seq_params(mb.cu_seqlens, device=device, kernel=kernel,
                                                           context_parallel=self.cfg.context_parallel_size)
        return ids.to(device), pos.to(device), extra

    def _router_losses_on(self) -> bool:
        cfg = self.cfg
        return bool(getattr(self.tconfig, "num_moe_experts", None)) and (cfg.moe_aux_loss_coeff > 0 or cfg.moe_z_loss_coeff > 0)

    @contextlib.contextmanager
    def _router_loss_scale(self, mbs: list[MicroBatch], *, forward_only: bool) -> Iterator[None]:
        """Scale the MoE router losses (load-balancing, z) to a token mean over the whole mini-batch.

        With ``calculate_per_token_loss`` Megatron's router adds ``loss x (tokens of the micro-batch on this
        rank)`` to the backward and expects ``finalize_model_grads`` to divide every gradient by the global
        token count; we skip that division (the policy loss is already a global token mean), so the schedule's
        backward scale for the router losses (``MoEAuxLossAutoScaler``, set to 1 after each forward) is replaced
        by S / (unpadded tokens of every micro-batch on every data-parallel rank; :func:`_router_padding_mask`),
        S the size of the router's TP x CP group (1 without SP / CP).
        Why S: under sequence or context parallelism each of the S ranks holds 1/S of a micro-batch's tokens. The
        z-loss share is the local mean x coeff / S, weighted by the local token count: the S shares add up to 1/S
        of the micro-batch's z-loss x its token count, hence x S. The load-balancing shares are partial sums of the
        micro-batch's loss whose weight is already the group's token count (``get_tokens_per_expert_and_token_count``
        all-reduces the per-expert counts in place, so its "local" count is the group's); x S would count them S
        times, so :func:`_router_token_weight` sets that weight to the group's count / S.
        Result: ``coeff x sum over layers of the token-weighted mean over micro-batches of Megatron's
        per-micro-batch loss``, whatever the data, tensor, context parallel or micro-batch layout.
        """
        if forward_only or not self._router_losses_on():
            yield
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        valid = sum(int((~_router_padding_mask(mb)).sum()) for mb in mbs)
        tokens = torch.tensor([float(valid)], dtype=torch.float64, device=self.device)
        dist.all_reduce(tokens, group=self.mpu.get_data_parallel_group())
        factor = self.mpu.get_tensor_and_context_parallel_world_size() / float(tokens.item())
        orig = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

        def set_loss_scale(scale: torch.Tensor) -> None:
            orig.__func__(scale * factor)

        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale)
        try:
            with _router_token_weight():
                yield
        finally:
            MoEAuxLossAutoScaler.set_loss_scale = orig

    def _routing(self, batch: SequenceBatch, *, update: bool) -> MicroBatchRouting | None:
        """MoE routing replay for one pass (``--megatron.routing_replay``): None (free routing), record, or replay.

        A batch carrying ``routed_experts`` is replayed (R3's passes, R2's update passes, or any re-run on a known
        routing); without them R2's old-log-prob pass records, and every other replayed pass refuses."""
        mode = self.cfg.routing_replay
        if mode == "none" or self.routing is None:
            return None
        if mode == "r2" and not update and batch.routed_experts is None:
            return MicroBatchRouting(self.routing, batch.sequences)  # the old-log-prob pass records
        if batch.routed_experts is None:
            source = ("compute_logprobs_and_entropy's 'routed_experts' output (the old-log-prob pass)" if mode == "r2"
                      else "the rollout engine (Generation.routed_experts, EngineConfig.return_routed_experts)")
            raise ValueError(f"--megatron.routing_replay {mode}: this pass needs batch.routed_experts from {source}; "
                             "pass them, or set --megatron.routing_replay none")
        from openrlhf_shape.megatron.routing_replay import check_routed_experts

        r = self.routing
        check_routed_experts(batch.routed_experts, batch.sequences, r.num_layers, r.top_k, r.num_experts)
        return MicroBatchRouting(r, batch.sequences, batch.routed_experts)

    # ------------------------------------------------------------------ log-probs / entropy
    def compute_logprobs_and_entropy(self, batch: SequenceBatch | dict) -> dict:
        """Forward only. Returns results on the last PP stage / TP rank 0, ``{}`` elsewhere.

        ``batch``: a :class:`~openrlhf_shape.batch.SequenceBatch` (or the same fields as a mapping).
        Output (gathered by :func:`openrlhf_shape.actor.rank_outputs.merge_rank_outputs`): ``{"indices": [i], "log_probs": [Tensor[T_i] f32 cpu], "entropy": [...]}`` where
        position j is the log-prob / full-vocab entropy (logits / temperature) of response token j.
        With ``--megatron.routing_replay`` r2 (recorded here) or r3 (``batch.routed_experts`` replayed) the output
        also carries ``"routed_experts"``: per sample ``[L_i, layers, top_k]``, to hand to :meth:`train_step`.
        ``"micro_batches"``: how many forward micro-batches of at most ``optim.forward_budget`` tokens
        (``--rollout.max_tokens_per_gpu``) this data-parallel rank ran.
        """
        self._require_onloaded(("params",), "compute_logprobs_and_entropy")
        self._require_model()
        batch = validate_batch(batch)
        temperature = float(batch.temperature)
        with self._mode():
            shard, mbs = self._plan(batch, forward_only=True)
            self.model.eval()

            def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
                lp, en = self._response_logprobs(hidden, mb, temperature, with_entropy=True)
                zero = torch.zeros((), device=hidden.device)
                return zero, torch.tensor(0, dtype=torch.int), {"mb": mb, "logp": lp.float().cpu(), "entropy": en.float().cpu()}

            routing = self._routing(batch, update=False)
            with torch.no_grad(), (routing.active() if routing else contextlib.nullcontext()):
                store = self._run_schedule(mbs, loss_fn, forward_only=True, routing=routing)
            self.model.train()
        if not self.holds_results or not shard:
            return {}
        out: dict[str, Any] = {"indices": [], "log_probs": [], "entropy": [], "micro_batches": len(mbs)}
        if routing is not None:
            out["routed_experts"] = []
        for rec in store:
            mb = rec["mb"]
            for row, (a, b) in zip(mb.rows, mb.resp_offsets):
                out["indices"].append(row)
                out["log_probs"].append(rec["logp"][a:b].clone())
                out["entropy"].append(rec["entropy"][a:b].clone())
                if routing is not None:
                    out["routed_experts"].append(routing.recorded[row] if routing.records else
                                                 torch.as_tensor(batch.routed_experts[row]).to(routing.replay.dtype))
        return out

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer step over the whole mini-batch (this rank trains on its DP shard).

        ``batch``: a :class:`~openrlhf_shape.batch.TrainBatch` (old log-probs, advantages and loss
        mask as ``[B, T]``; optional rollout-correction weights ``is_weights`` ``[B, T]``; with
        ``--megatron.routing_replay`` r2/r3 ``routed_experts``, replayed in the forward and backward). The PPO/DAPO
        loss is normalised by the number of valid response tokens of the whole mini-batch. Returns
        float metrics, identical on all ranks.
        """
        self._require_onloaded(("params", "grads", "optimizer"), "train_step")
        self._require_model()
        self._require_optimizer("train_step")
        optim = self.cfg.optim
        eps_low, eps_high = optim.policy_clip_low_high
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"train_step needs an openrlhf_shape.batch.TrainBatch, got {type(batch).__name__}")
        batch.validate()
        masks = batch.loss_mask.bool() & length_mask(batch.response_lens, batch.loss_mask.shape[1])
        num_global_tokens = int(masks.sum())
        num_global_samples = int(masks.any(-1).sum())  # gspo's sample-level denominator
        temperature = float(batch.temperature)

        def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
            lp, en = self._response_logprobs(hidden, mb, temperature, with_entropy=True)
            loss, stats = micro_batch_loss(lp, en, mb, batch, masks, num_global_tokens, eps_low=eps_low,
                                           eps_high=eps_high, dual_clip=optim.dual_clip,
                                           loss_type=optim.policy_loss_type, num_global_samples=num_global_samples)
            return loss, torch.tensor(int(stats["num_tokens"]), dtype=torch.int), stats

        with self._mode():
            shard, mbs = self._plan(batch, forward_only=False)
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            routing = self._routing(batch, update=True)
            with routing.active() if routing else contextlib.nullcontext():
                store = self._run_schedule(mbs, loss_fn, forward_only=False, routing=routing)
            sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64)
            if self.holds_results and shard:
                for rec in store:
                    for j, k in enumerate(METRIC_KEYS):
                        sums[j] += float(rec[k])
            sums = sums.to(self.device)
            dist.all_reduce(sums)  # results live on one rank per DP replica; others add zeros
            sums = sums.cpu()
            loss_finite = sums[METRIC_KEYS.index("nonfinite")].item() == 0
            lr_used = float(self.optimizer.param_groups[0]["lr"])
            found_inf = self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm()) if not found_inf else float("nan")
            ok = loss_finite and not found_inf and math.isfinite(grad_norm)
            if ok:
                if optim.max_norm > 0:
                    _clip_to_total_norm(self.optimizer, optim.max_norm, grad_norm)
                ok = bool(self.optimizer.step_with_ready_grads())
            if ok:
                self.scheduler.step(increment=1)
                self.step += 1
            else:
                self.optimizer.zero_grad()
        return step_metrics(sums, grad_norm=grad_norm, lr=lr_used, ok=ok, step=self.step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str, extra: Optional[dict] = None) -> None:
        """Atomically write model + optimizer + scheduler + RNG + step (+ ``extra``) to ``ckpt_dir``."""
        self._require_model()
        self._require_optimizer("save_checkpoint")
        self._require_onloaded(("params", "grads", "optimizer"), "save_checkpoint")
        with self._mode():
            save_distributed_checkpoint(self.state, ckpt_dir, extra or {})

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore everything saved by :meth:`save_checkpoint`; returns its ``extra``."""
        self._require_model()
        self._require_optimizer("load_checkpoint")
        with self._mode():
            return load_distributed_checkpoint(self.state, ckpt_dir)

    # ------------------------------------------------------------------ HF export
    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named weights in buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

        All ranks must iterate in lockstep (the bridge gathers TP shards and PP stages per
        parameter); rank 0 yields real buckets of detached CPU copies, other ranks yield ``[]``
        as often as rank 0 yields a bucket.
        """
        self._require_model()
        self._require_onloaded(("params",), "iter_hf_weights")
        with self._mode():
            yield from iter_buckets(self.state, bucket_bytes)

    def export_hf(self, out_dir: str) -> None:
        """Write an HF directory (safetensors + config + tokenizer) atomically to ``out_dir``."""
        self._require_model()
        with self._mode():
            export_hf_dir(self.state, out_dir)

    # ------------------------------------------------------------------ teardown
    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        """Destroy model-parallel state and the process group (idempotent)."""
        try:
            if self.model is not None:
                self.model = self.optimizer = self.scheduler = None
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()




def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def _router_token_weight() -> Iterator[None]:
    """The load-balancing loss share's token weight on every rank = the micro-batch's unpadded tokens over the
    router's reduce group / the group's size, so that :meth:`MegatronRankWorker._router_loss_scale`'s factor S
    (which the z-loss needs) counts it once. megatron-core 0.16.1 returns the group's count as ``local_num_tokens``
    (its all-reduce of the per-expert counts is in place); the weight set here does not depend on that."""
    from megatron.core.transformer.moe import router as moe_router

    orig = moe_router.get_tokens_per_expert_and_token_count

    def counts(routing_map: torch.Tensor, reduce_group, topk: int | None = None, with_padding_mask: bool = False):
        per_expert, _local, total = orig(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        return per_expert, total / reduce_group.size(), total

    moe_router.get_tokens_per_expert_and_token_count = counts
    try:
        yield
    finally:
        moe_router.get_tokens_per_expert_and_token_count = orig


def _router_padding_mask(mb: MicroBatch) -> torch.Tensor:
    """[rows, seq] bool for Megatron's MoE router, True = left out of the router losses: padding (right padding of
    a padded micro-batch, the tail of a packed one), and all but the first token of a filler micro-batch (a fully masked one would divide by zero token counts inside
    Megatron's loss functions; its one token is a pad).

    Without it a pad position whose embedding is zero (HF zero-initialises the ``padding_idx`` row) sends the
    z-loss through RMSNorm at a zero input, which amplifies by 1/sqrt(eps): measured 436 vs 10.2 grad norm."""
    if not mb.rows:
        mask = torch.ones_like(mb.input_ids, dtype=torch.bool)
        mask[0, 0] = False
        return mask
    return mb.padding_mask()


def _clip_to_total_norm(optimizer, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / total_norm)`` (``total_norm``: the global L2 norm over all
    parameters, from ``optimizer.get_grad_norm()``).

    A MoE model with expert parallelism has a ``ChainedOptimizer`` of two parts (dense parameters, reduced
    over data parallelism; experts, over the expert-data-parallel group), whose ``clip_grad_norm`` refuses
    more than one part; each part is clipped by the norm of the whole model, as megatron-core's own step does.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm, total_norm,
                                         opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _wrap_ddp(module, tconfig, cfg: MegatronConfig):
    """Megatron DDP around ``module`` (fp32 grad buffers), wired into ``tconfig``'s gradient hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    model = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=module)
    model.broadcast_params()
    # The loss is normalised by the global valid-token count already: no extra scaling.
    tconfig.finalize_model_grads_func = _finalize_without_token_scaling(finalize_model_grads)
    tconfig.no_sync_func = model.no_sync
    tconfig.grad_scale_func = None
    return model


def _build_optimizer(model, cfg: MegatronConfig):
    """(Megatron Adam over ``model``, its LR / weight-decay schedule: linear warm-up, then ``lr_decay_style``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim, adam = cfg.optim, cfg.optim.adam
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=adam.lr,
        min_lr=optim.final_lr,
        weight_decay=adam.weight_decay,
        adam_beta1=adam.betas[0],
        adam_beta2=adam.betas[1],
        adam_eps=adam.eps,
        clip_grad=optim.max_norm,
        bf16=cfg.use_bf16,
        params_dtype=cfg.params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    warmup = optim.warmup_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        # step k < warmup uses lr * (k + 1) / (warmup + 1): no wasted zero-lr first step
        init_lr=adam.lr / (warmup + 1),
        max_lr=adam.lr,
        min_lr=optim.final_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=optim.total_steps,
        lr_decay_style=optim.lr_scheduler,
        start_wd=adam.weight_decay,
        end_wd=adam.weight_decay,
        wd_incr_steps=optim.total_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _finalize_without_token_scaling(finalize):
    def finalize_model_grads_func(model, num_tokens=None, *args, **kwargs):
        return finalize(model, None, *args, **kwargs)

    return finalize_model_grads_func
