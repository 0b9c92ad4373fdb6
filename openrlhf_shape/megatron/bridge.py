"""HF <-> Megatron through mbridge, with the layer spec chosen in one place.

mbridge 0.15.1 builds every model with the transformer-engine spec and TE parameter names
(``linear_qkv.layer_norm_weight``). On a machine without CUDA we use Megatron's local spec
(``get_gpt_layer_local_spec``) whose norms are separate modules (``input_layernorm``,
``pre_mlp_layernorm``). :func:`make_bridge` returns an instance of a small subclass of the
registered mbridge class (Qwen3 / Qwen2 / Llama / Qwen3-MoE) that

* picks the spec from ``MegatronConfig.layer_spec`` ("auto": the platform profile's, TE on GPU and
  local on CPU; the local spec's core attention is Megatron's or torch SDPA,
  ``MegatronConfig.local_attention``);
* adds the local-spec key names (per instance, never in mbridge's class-level dicts), MoE experts as
  ``SequentialMLP`` renamed to mbridge's grouped names (docs/moe.md);
* maps ``output_layer.weight`` to ``model.embed_tokens.weight`` for tied embeddings (per instance);
* reads ``rope_theta`` from ``rope_parameters`` (transformers 5) or the legacy attribute;
* turns our :class:`MegatronConfig` into TransformerConfig overrides
  (:func:`transformer_config_overrides`, the only place that does so).
"""

from __future__ import annotations

import re
from typing import Any, Optional


from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.platform import Platform

_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight$")
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe")


def transformer_config_overrides(cfg: MegatronConfig, *, on_cpu: bool, local_spec: Optional[bool] = None) -> dict[str, Any]:
    """Our config -> keyword overrides of Megatron's ``TransformerConfig`` (applied by mbridge).

    mbridge fills the architecture fields from the HF config and the parallel sizes from
    ``parallel_state``; everything else that we decide is here. ``local_spec`` defaults to
    ``on_cpu`` (the "auto" choice).
    """
    if local_spec is None:
        local_spec = on_cpu
    overrides: dict[str, Any] = {
        "sequence_parallel": bool(cfg.sequence_parallel),
        # Packed / dynamic micro-batches have different lengths; the PP schedule must exchange shapes
        # (without PP nothing is exchanged).
        "variable_seq_lengths": cfg.pipeline_model_parallel_size > 1,
        # The policy loss is already normalised by the global valid-token count, so the schedule
        # must not divide by the number of micro-batches and DDP must not average over DP.
        "calculate_per_token_loss": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "batch_p2p_comm": False,
    }
    if cfg.optim.gradient_checkpointing_enable:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if local_spec or on_cpu:
        overrides.update(
            # The fused kernels behind these switches come from transformer-engine / Apex / Megatron's
            # compiled extensions: absent on CPU and on a GPU without TE (mbridge turns
            # masked_softmax_fusion on, which then fails at the first attention with sk <= 4096).
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
    if on_cpu:
        overrides.update(use_cpu_initialization=True)
    if local_spec:
        overrides.update(moe_grouped_gemm=False)  # the local spec's experts are SequentialMLP
    return overrides


def moe_config_overrides(cfg: MegatronConfig) -> dict[str, Any]:
    """The MoE router losses and router kernel of ``cfg`` as TransformerConfig overrides (MoE models only).

    0 keeps mbridge's RL default (``moe_router_load_balancing_type="none"``, no z-loss); a positive
    ``moe_aux_loss_coeff`` turns on Megatron's per-micro-batch switch load-balancing loss ("aux_loss"), a
    positive ``moe_z_loss_coeff`` the router z-loss. How they are scaled in the gradient: the worker
    (``router_loss.py:router_loss_scale``). ``moe_router_fusion``: megatron-core's fused top-k kernel (GPU, transformer-engine).
    """
    out: dict[str, Any] = {"moe_z_loss_coeff": float(cfg.moe_z_loss_coeff) if cfg.moe_z_loss_coeff > 0 else None,
                           "moe_router_fusion": bool(cfg.moe_router_fusion)}
    if cfg.moe_aux_loss_coeff > 0:
        out.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(cfg.moe_aux_loss_coeff))
    else:
        out.update(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    return out


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not supported by the Megatron backend yet; only plain RoPE"
        )
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if legacy_scaling and legacy_scaling.get("rope_type", legacy_scaling.get("type")) not in ("default", None):
        raise NotImplementedError(f"rope_scaling={legacy_scaling!r} is not supported by the Megatron backend yet")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


class _ShapeBridgeMixin:
    """Overrides shared by the Qwen3 / Qwen2 / Llama bridges (see module docstring)."""

    _shape_overrides: dict[str, Any] = {}
    _shape_local_spec: bool = True
    _shape_local_attention: str = "megatron"
    _shape_on_cpu: bool = False
    _shape_moe_overrides: dict[str, Any] = {}
    _shape_loading_dense_only: bool = False  # set by load_weights while mbridge loads all but the local experts
    _shape_value_head: Optional[str] = None  # a value model's head name (``score``): its output layer is [1, h]
    _shape_head_in_dir: bool = True  # False: the directory has no head (a critic from a causal LM): not loaded
    _shape_loading: bool = False  # set by load_weights (the export still names the head)

    def _build_base_config(self, text_config_key=None, **kwargs):  # type: ignore[override]
        kwargs.update(self._shape_overrides)
        if kwargs.get("num_moe_experts"):
            kwargs.update(self._shape_moe_overrides)
        # MoE keeps mbridge's all-to-all token dispatcher on CPU too (cpu.py gives it what it needs without CUDA
        # streams): it takes unequal token counts per expert-parallel rank and variable_seq_lengths (PP > 1).
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]

    def _adjust_mapping_for_shared_weights(self) -> None:
        # Per-instance copies: upstream mutates class-level dicts, which leaks between bridges.
        self._DIRECT_MAPPING = dict(type(self)._DIRECT_MAPPING)
        self._ATTENTION_MAPPING = dict(type(self)._ATTENTION_MAPPING)
        self._MLP_MAPPING = dict(type(self)._MLP_MAPPING)
        self._OTHER_MAPPING = dict(type(self)._OTHER_MAPPING)
        self._DIRECT_MAPPING["output_layer.weight"] = "lm_head.weight"
        if self._shape_local_spec:
            # Local spec: the pre-attention / pre-MLP norms are modules of the layer.
            self._OTHER_MAPPING["input_layernorm.weight"] = ["model.layers.{layer_number}.input_layernorm.weight"]
            self._MLP_MAPPING = {
                "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
                **self._MLP_MAPPING,
            }
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight"
        if self._shape_value_head:  # a value model: the output layer is the [1, h] head, untied (OpenRLHF's format)
            self._DIRECT_MAPPING["output_layer.weight"] = f"{self._shape_value_head}.weight"

    def _get_hf_shared_weight_keys(self) -> list[str]:
        if getattr(self.hf_config, "tie_word_embeddings", False):
            return ["model.embed_tokens.weight"]
        return []

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None):
        self.has_vp_stage = False
        if not self._shape_local_spec:
            return super()._get_transformer_layer_spec(vp_stage)  # type: ignore[misc]
        from openrlhf_shape.megatron.attention import local_layer_spec

        return local_layer_spec(qk_layernorm=bool(self.config.qk_layernorm), attention=self._shape_local_attention,
                                num_experts=self.config.num_moe_experts)

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        # The local spec's experts are SequentialMLP modules (``mlp.experts.local_experts.E.linear_fc1.weight``);
        # mbridge knows experts by TE's grouped names (``mlp.experts.linear_fc1.weightE``). Renaming here, before
        # mbridge's own expert-parallel handling, lets it do what it does for TE: on load the global expert id
        # (local id + this EP rank's offset), on export (``consider_ep=False``) the all-gather of every EP rank's
        # experts under their global ids. Renamed later, the export of an EP rank would carry its own experts only.
        mapping = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)  # type: ignore[misc]
        ep = getattr(self.mpu, "ep_size", 1) or 1  # offset: this EP rank's first global expert id
        offset = self.config.num_moe_experts // ep * self.mpu.ep_rank if consider_ep and ep > 1 else 0
        for local_name, global_name in list(mapping.items()):
            m = _LOCAL_EXPERT.search(global_name)
            if global_name == "output_layer.weight" and self._shape_loading and not self._shape_head_in_dir:
                del mapping[local_name]  # drawn by the caller (megatron/value.py)
            elif m and self._shape_loading_dense_only:
                del mapping[local_name]  # load_weights reads these itself (_load_local_experts)
            elif m:
                mapping[local_name] = _LOCAL_EXPERT.sub(rf"mlp.experts.\g<fc>.weight{int(m.group('e')) + offset}",
                                                        global_name)
        return mapping

    def load_weights(self, models: list, weights_path: str, memory_efficient: bool = False) -> None:  # type: ignore[override]
        """mbridge's load, except the local spec's experts, which each rank reads itself (:meth:`_load_local_experts`).

        mbridge picks the expert path by the parameter's own name (``.mlp.experts.linear_fc``: TE's grouped experts);
        the local spec's ``mlp.experts.local_experts.E.linear_fcN.weight`` take its dense path instead: read by TP rank 0
        with its own expert ids and scattered over the TP group as TP shards. That equals the expert path only when
        expert TP = TP; with ``--megatron.expert_tensor_parallel_size 1`` at TP 2 it fails (each rank holds whole,
        different experts)."""
        self._shape_loading = True
        try:
            if not (self._shape_local_spec and self.config.num_moe_experts):
                return super().load_weights(models, weights_path, memory_efficient=memory_efficient)  # type: ignore[misc]
            self._shape_loading_dense_only = True
            try:
                super().load_weights(models, weights_path, memory_efficient=memory_efficient)  # type: ignore[misc]
            finally:
                self._shape_loading_dense_only = False
            for model in models:
                self._load_local_experts(model)
        finally:
            self._shape_loading = False

    def _load_local_experts(self, model) -> None:
        """This rank's experts of ``model`` (local spec, SequentialMLP) from the HF files: the global expert id from the
        EP rank's offset, HF's gate/up/down tensors to Megatron's fc1 [2 I, h] / fc2 [h, I], then this rank's
        expert-TP shard (mbridge's own split: gate and up split separately, fc2 along its input dim)."""
        import torch

        etp_size, etp_rank = self.mpu.etp_size, self.mpu.etp_rank
        params = model.state_dict()
        for local_name, global_name in self._weight_name_mapping_mcore_local_to_global(model).items():
            if not _LOCAL_EXPERT.search(local_name):
                continue
            hf_names = self._weight_name_mapping_mcore_to_hf(global_name)
            hf = self.safetensor_io.load_some_hf_weight(hf_names)
            weight = self._weight_to_mcore_format(global_name, [hf[n] for n in hf_names])
            param = params[local_name]
            shard = list(self._weight_split_across_tp(global_name, weight, param, etp_size))[etp_rank]
            if shard.shape != param.shape:
                raise ValueError(f"{global_name}: expert shard {tuple(shard.shape)} for a parameter of "
                                 f"{tuple(param.shape)} (expert TP {etp_size})")
            with torch.no_grad():
                param.copy_(shard.to(param.device, dtype=param.dtype))

    def _get_gptmodel_args(self) -> dict:
        return dict(
            vocab_size=self.hf_config.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=_rope_theta(self.hf_config),
        )


def make_bridge(hf_config: Any, cfg: MegatronConfig, *, platform: Platform, value_head: Optional[str] = None,
                head_in_dir: bool = True):
    """An mbridge bridge for ``hf_config`` with our spec choice and TransformerConfig overrides.

    ``platform``: the rank's profile (``layer_spec`` "auto" and the CPU-only overrides follow it). ``value_head``:
    a value model's head name (its output layer ``[1, h]`` maps to ``<value_head>.weight``, read unless
    ``head_in_dir`` is False; the model is built with mbridge's ``make_value_model``).
    Call after ``parallel_state.initialize_model_parallel`` (mbridge reads the parallel sizes).
    """
    on_cpu = platform.on_cpu
    from mbridge.core.bridge import _MODEL_REGISTRY

    import mbridge.models  # noqa: F401  (registers the bridges)

    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES or model_type not in _MODEL_REGISTRY:
        raise ValueError(
            f"model_type={model_type!r} is not supported by the Megatron backend; "
            f"supported: {SUPPORTED_MODEL_TYPES}"
        )
    base = _MODEL_REGISTRY[model_type]
    local_spec = cfg.layer_spec_on(platform) == "local"
    if on_cpu and not local_spec:
        raise ValueError("MegatronConfig.layer_spec='te' needs a GPU; on CPU use layer_spec='auto' or 'local'")
    cls = type(
        f"Shape{base.__name__}",
        (_ShapeBridgeMixin, base),
        {
            "_shape_overrides": transformer_config_overrides(cfg, on_cpu=on_cpu, local_spec=local_spec),
            "_shape_local_spec": local_spec,
            "_shape_local_attention": cfg.local_attention,
            "_shape_on_cpu": on_cpu,
            "_shape_moe_overrides": moe_config_overrides(cfg),
            "_shape_value_head": value_head,
            "_shape_head_in_dir": head_in_dir,
        },
    )
    return cls(hf_config, dtype=cfg.params_dtype)


