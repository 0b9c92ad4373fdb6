"""Building one Megatron rank's model and optimizer into its :class:`~openrlhf_shape.megatron.state.ActorState`:
the rank's GPT stage from the bridge (HF weights), the bf16 wrapper, Megatron's DDP with fp32 gradient buffers and
Megatron's Adam (its LR is set before each step: :func:`~openrlhf_shape.actor.lr_schedule.apply_lr`). Functions of the
state; the worker calls them inside its device mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.pad_embedding import detach_pad_lookups
from openrlhf_shape.megatron.routing_replay import RoutingReplay
from openrlhf_shape.megatron.state import ActorState


def build_model(state: ActorState, hf_dir: str, *, load_weights: bool = True, train: bool = True,
                value_head: str | None = None, head_in_dir: bool = True) -> dict:
    """Build the GPT model through the bridge, load HF weights, build the optimizer into ``state``; returns
    the model's description (parameter counts, layout, MoE settings).

    ``load_weights=False`` keeps Megatron's random initialisation (benchmarks: only the shapes of ``hf_dir``'s
    config matter). ``train=False`` builds a forward-only model: no DDP gradient buffers, no optimizer.
    ``value_head``: a value model (:mod:`~openrlhf_shape.megatron.value`), its output layer the ``[1, h]`` head of
    that name, replicated over the TP ranks of the last stage (read from ``hf_dir`` unless ``head_in_dir`` is False).
    """
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoConfig

    from openrlhf_shape.megatron.bridge import make_bridge

    cfg = state.cfg
    hf_config = AutoConfig.from_pretrained(hf_dir)
    cfg.validate_against_model(hf_config, state.world_size)
    if value_head is not None:
        hf_config.tie_word_embeddings = False  # the head is a weight of its own: no embedding shared with it
    bridge = make_bridge(hf_config, cfg, platform=state.platform, value_head=value_head, head_in_dir=head_in_dir)
    gpt = _build_gpt(state, bridge, hf_dir, load_weights, value_model=value_head is not None)
    state.routing = None if cfg.routing_replay == "none" else RoutingReplay(gpt, sequence_parallel=cfg.sequence_parallel)
    module = Float16Module(bridge.config, gpt) if cfg.use_bf16 else gpt
    optimizer = None
    if train:
        module = _wrap_ddp(module, bridge.config, cfg)
        optimizer = _build_optimizer(module, cfg)
    else:
        for p in module.parameters():
            p.requires_grad_(False)
    state.bridge, state.tconfig, state.hf_config, state.hf_dir = bridge, bridge.config, hf_config, hf_dir
    state.value_format = None  # a value model's: set by megatron/value.py after this build
    state.model, state.optimizer, state.step = module, optimizer, 0  # the LR schedule starts (a load sets its step)
    return _model_info(state, gpt)


def _build_gpt(state: ActorState, bridge, hf_dir: str, load_weights: bool, value_model: bool = False):
    """This rank's GPT stage from the bridge's provider, on its device, with HF weights when asked (a value model:
    mbridge's callback swaps the last stage's output layer for a replicated ``[1, h]`` linear)."""
    from mbridge.utils.post_creation_callbacks import make_value_model
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    provider = bridge._model_provider([make_value_model] if value_model else [])
    gpt = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    detach_pad_lookups(gpt, getattr(bridge.hf_config, "pad_token_id", None))
    for p in gpt.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if state.platform.on_gpu:
        gpt.cuda(torch.cuda.current_device())
    if load_weights:
        bridge.load_weights([gpt], hf_dir)
    return gpt


def _model_info(state: ActorState, gpt) -> dict:
    from megatron.core import parallel_state as mpu

    cfg = state.cfg
    n_local = sum(p.numel() for p in gpt.parameters())
    # Each parameter once: dense ones from data-parallel rank 0, and of those replicated over the TP group (norms,
    # the router) TP rank 0's only; experts (``allreduce=False``: sharded over the expert-parallel and expert-TP
    # ranks, replicated over the expert-data-parallel group) from expert-DP rank 0.
    n_expert = sum(p.numel() for p in gpt.parameters() if not getattr(p, "allreduce", True))
    n_tp_replicated = sum(p.numel() for p in gpt.parameters()
                          if getattr(p, "allreduce", True) and not getattr(p, "tensor_model_parallel", False))
    dense = n_local - n_expert - (n_tp_replicated if mpu.get_tensor_model_parallel_rank() else 0)
    count = (dense if mpu.get_data_parallel_rank(with_context_parallel=True) == 0 else 0) + (
        n_expert if mpu.get_expert_data_parallel_rank() == 0 else 0)
    totals = torch.tensor([count], dtype=torch.long, device=state.device)
    dist.all_reduce(totals)
    return {
        "num_parameters": int(totals.item()),
        "num_parameters_local": int(n_local),
        "model_type": state.hf_config.model_type,
        "tp": cfg.tensor_model_parallel_size,
        "pp": cfg.pipeline_model_parallel_size,
        "cp": cfg.context_parallel_size,
        "dp": state.dp_size,
        "dtype": str(cfg.params_dtype),
        **_moe_info(state),
    }


def _moe_info(state: ActorState) -> dict:
    """What Megatron's TransformerConfig says about experts and router losses ({} for a dense model)."""
    from megatron.core import parallel_state as mpu

    tc = state.tconfig
    if not getattr(tc, "num_moe_experts", None):
        return {}
    return {"moe": {"num_experts": int(tc.num_moe_experts), "ep": state.cfg.expert_model_parallel_size,
                    # what reached megatron-core: its expert groups (parallel_state) and TransformerConfig
                    "etp": mpu.get_expert_tensor_parallel_world_size(),
                    "ep_group": mpu.get_expert_model_parallel_world_size(),
                    "config_etp": tc.expert_tensor_parallel_size, "router_fusion": tc.moe_router_fusion,
                    "token_dispatcher": tc.moe_token_dispatcher_type,
                    "load_balancing": tc.moe_router_load_balancing_type,
                    "aux_loss_coeff": tc.moe_aux_loss_coeff, "z_loss_coeff": tc.moe_z_loss_coeff}}


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
    tconfig.finalize_model_grads_func = (
        lambda model, num_tokens=None, *args, **kwargs: finalize_model_grads(model, None, *args, **kwargs))
    tconfig.no_sync_func = model.no_sync
    tconfig.grad_scale_func = None
    return model


def _build_optimizer(model, cfg: MegatronConfig):
    """Megatron Adam over ``model``; no decay on biases and norms (their groups' ``wd_mult`` 0). No scheduler: the
    step sets each update's LR (``actor/lr_schedule.py``), as the DeepSpeed backend does."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optim, adam = cfg.optim, cfg.optim.adam
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=adam.lr,
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
    for group in optimizer.param_groups:  # what Megatron's scheduler would set: the decay times the group's multiplier
        group["weight_decay"] = adam.weight_decay * group.get("wd_mult", 1.0)
    return optimizer
