"""Configuration of the Megatron actor backend, validated at construction.

:class:`MegatronSettings` is the parallel layout and Megatron's own switches (the flag tree's
``megatron`` section extends it: ``--megatron.<field>``); :class:`MegatronConfig` is what a rank is
handed: those plus the backend-neutral training settings, ``optim`` (:mod:`openrlhf_shape.actor.optim`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.platform import Platform

_LAYER_SPECS = ("auto", "local", "te")
_LOCAL_ATTENTIONS = ("megatron", "sdpa")
_CKPT_FORMATS = ("dp_reshardable", "fully_reshardable")
_REPLAY_NOT_BUILT = {  # layouts routing replay does not cover yet, and why
    "pipeline_model_parallel_size": "the routing of every stage would have to be gathered, and 1F1B with "
                                    "recompute needs a backward replay queue",
    "expert_model_parallel_size": "expert parallelism tops ranks up with filler micro-batches that carry no "
                                  "recorded routing",
    "context_parallel_size": "each CP rank routes its own chunks of a sequence, so the recorded routing would have "
                             "to be gathered over the CP group in the split's order and each rank's chunks handed back",
}


@dataclass
class MegatronSettings:
    """The parallel layout and the Megatron switches (what ``--megatron.*`` sets)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Context parallelism (--megatron.context_parallel_size): every sequence split over this many ranks, megatron-core's
    # load-balanced split (2 x CP chunks, rank r holds chunks r and 2 x CP - 1 - r; packed documents each padded to a
    # multiple of 2 x CP). Ranks are laid out TP x CP x DP x PP (megatron-core's order); the data-parallel size is
    # world / (TP x PP x CP) and gradients are summed over DP x CP. The micro-batch token budgets are per GPU, so a
    # CP group's micro-batch holds CP x --train.max_tokens_per_gpu tokens (as OpenRLHF's ring attention).
    context_parallel_size: int = 1
    # MoE experts sharded over this many ranks (--megatron.expert_model_parallel_size); 1 for dense
    expert_model_parallel_size: int = 1
    # Each expert's weights split this many ways (--megatron.expert_tensor_parallel_size: megatron-core's
    # expert_tensor_parallel_size, handed to parallel_state). None = the TP size (megatron-core's default). Expert
    # ranks are laid out as ETP x EP x DP x PP, so ETP x EP x PP must divide the world; ETP 1 with EP = TP puts
    # whole experts on the TP ranks of one replica instead of splitting each over them.
    expert_tensor_parallel_size: Optional[int] = None
    # MoE router losses (docs/moe.md). 0 = off, the default: mbridge's RL default and the paper's runs (dense)
    # have no load-balancing loss, and the policy should not be pulled towards balance the rollouts did not have.
    # > 0: Megatron's switch load-balancing loss ("aux_loss": num_experts x sum_e f_e P_e per micro-batch and
    # layer; HF's qwen3_moe config ships router_aux_loss_coef=0.001) and the router z-loss (ST-MoE, mean
    # logsumexp(router logits)^2), each summed over layers and averaged over the mini-batch's tokens, added
    # to the policy loss's gradient with this weight.
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    # Megatron layer spec: "te" (transformer-engine modules and key names), "local" (Megatron's
    # torch modules), "auto" = te on GPU ranks, local on CPU (resolved in the rank process).
    layer_spec: str = "auto"
    # Core attention of the local spec: "megatron" (DotProductAttention: materialises the
    # [batch*heads, s, s] scores in a persistent buffer) or "sdpa" (torch scaled_dot_product_attention,
    # causal; flash / memory-efficient kernels on GPU). Ignored under the TE spec.
    local_attention: str = "megatron"
    bf16: Optional[bool] = None  # None = auto: True on GPU ranks, False on CPU
    # checkpoint format for the distributed optimizer: "dp_reshardable" (same layout) or
    # "fully_reshardable" (the layout may change between save and load)
    dist_optimizer_ckpt_format: str = "fully_reshardable"
    # MoE routing replay (megatron/routing_replay.py): "none"; "r2" = the old-log-prob pass records each token's
    # experts and the update replays them; "r3" = the rollout engine's experts are replayed in both passes
    routing_replay: str = "none"
    # megatron-core's fused top-k router kernel (TransformerConfig.moe_router_fusion: transformer-engine >= 2.6 on a
    # GPU). Off by default. Its path returns the kernel's own top-k before router replay applies, so
    # routing_replay refuses it.
    moe_router_fusion: bool = False

    def __post_init__(self) -> None:
        self._check_layout()
        name = type(self).__name__
        if self.layer_spec not in _LAYER_SPECS:
            raise ValueError(f"{name}.layer_spec must be one of {_LAYER_SPECS}, got {self.layer_spec!r}")
        if self.local_attention not in _LOCAL_ATTENTIONS:
            raise ValueError(f"{name}.local_attention must be one of {_LOCAL_ATTENTIONS}, got {self.local_attention!r}")
        if self.layer_spec == "te" and self.local_attention != "megatron":
            raise ValueError(f"{name}.local_attention applies to the local layer spec only; with layer_spec='te' "
                             "leave local_attention='megatron' (TE brings its own fused attention)")
        self._check_moe()

    def _check_layout(self) -> None:
        name = type(self).__name__
        for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            value = getattr(self, size)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{size} must be an integer >= 1, got {value!r}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"{name}.expert_tensor_parallel_size must be an integer >= 1 or None (the TP size), "
                             f"got {etp!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(f"{name}.sequence_parallel=True needs tensor_model_parallel_size > 1; "
                             "set sequence_parallel=False or raise the TP size")
        if self.dist_optimizer_ckpt_format not in _CKPT_FORMATS:
            raise ValueError(f"{name}.dist_optimizer_ckpt_format must be 'dp_reshardable' or "
                             f"'fully_reshardable', got {self.dist_optimizer_ckpt_format!r}")

    def _check_moe(self) -> None:
        from openrlhf_shape.megatron.routing_replay import ROUTING_REPLAY_MODES

        name = type(self).__name__
        for coeff in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, coeff)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}.{coeff} must be a number >= 0 (0 turns the loss off), got {value!r}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"{name}.routing_replay must be one of {ROUTING_REPLAY_MODES}, got {self.routing_replay!r}")
        for size, why in _REPLAY_NOT_BUILT.items():
            if self.routing_replay != "none" and getattr(self, size) > 1:
                raise ValueError(f"{name}.routing_replay={self.routing_replay!r} with {size}={getattr(self, size)} "
                                 f"is not built ({why}); use {size}=1 or routing_replay='none' (docs/moe.md)")
        if self.routing_replay != "none" and self.moe_router_fusion:
            # megatron-core 0.16.1 moe_utils.topk_routing_with_score_function: `if fused: return
            # fused_topk_with_score_function(...)` comes before the router_replay branch (tests/megatron holds it)
            raise ValueError(f"{name}.routing_replay={self.routing_replay!r} with {name}.moe_router_fusion=True: "
                             "megatron-core's fused router returns its own top-k before router replay applies, so "
                             "the replayed experts would be ignored without an error; set --megatron.moe_router_fusion "
                             "false (the default) to replay, or --megatron.routing_replay none to keep the fused router "
                             "(docs/moe.md)")


@dataclass
class MegatronConfig(MegatronSettings):
    """One Megatron rank's settings: the layout and switches, and ``optim``, the training settings
    both backends share (Adam, LR schedule, clipping, policy-loss clip, micro-batch budget, seed), and
    ``value_head_prefix``: a value model's head name when its config.json names none (``--ds.value_head_prefix``, the
    flag both backends read under OpenRLHF's name)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    value_head_prefix: str = "score"

    @property
    def ranks_per_replica(self) -> int:
        """Ranks that hold one data-parallel replica: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def sequence_multiple(self) -> int:
        """What every sequence (a padded micro-batch's row, a packed micro-batch's document) is padded to: 2 x CP
        chunks, each divisible by TP under sequence parallel; 1 without CP (a packed micro-batch's tail then takes
        the TP multiple: :meth:`pack_multiple`)."""
        cp = self.context_parallel_size
        return 2 * cp * (self.tensor_model_parallel_size if self.sequence_parallel else 1) if cp > 1 else 1

    @property
    def pack_multiple(self) -> int:
        """What a whole micro-batch's length is padded to: the TP size under sequence parallel, else 1 (under CP
        every document is a multiple of it already)."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    @property
    def expert_tensor_parallel(self) -> int:
        """The expert TP size in effect: ``expert_tensor_parallel_size``, or the TP size when None."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def use_bf16(self) -> bool:
        """bf16=None means auto: the platform profile's Megatron dtype. A rank resolves it from the
        profile the driver handed it (:meth:`for_platform`), so a driver without a GPU (a Ray head
        node) still gives GPU ranks bf16. Reading it unresolved is an error (no second CPU/GPU decision)."""
        if self.bf16 is None:
            raise ValueError("MegatronConfig.bf16 is 'auto' (None) here: resolve it for the rank's profile with "
                             "for_platform(platform) first (openrlhf_shape/platform.py decides CPU vs GPU once)")
        return bool(self.bf16)

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.use_bf16 else torch.float32

    def layer_spec_on(self, platform: Platform) -> str:
        """"te" or "local": ``layer_spec``, with "auto" taken from the platform profile."""
        return platform.layer_spec if self.layer_spec == "auto" else self.layer_spec

    def for_platform(self, platform: Platform) -> "MegatronConfig":
        """This config with ``bf16`` decided by ``platform`` (ranks call it on the handed profile)."""
        if self.bf16 is not None:
            return self
        return replace(self, bf16=platform.trainer_dtype == "bfloat16")

    def check_device(self, platform: Platform) -> None:
        """Called by each rank with its profile: refuse bf16 or the TE spec where they cannot run."""
        if self.bf16 and not platform.on_gpu:
            raise ValueError(
                "MegatronConfig.bf16=True needs a GPU; on CPU leave bf16=None (auto) or set False"
            )
        if self.moe_router_fusion and not platform.on_gpu:
            raise ValueError("MegatronConfig.moe_router_fusion=True needs transformer-engine's fused router kernel on a "
                             "GPU; on CPU leave moe_router_fusion=False")
        if self.layer_spec_on(platform) == "te":
            if not platform.on_gpu:
                raise ValueError(
                    "MegatronConfig.layer_spec='te' needs a GPU; on CPU use layer_spec='auto' or 'local'"
                )
            try:
                import transformer_engine.pytorch  # noqa: F401
            except ImportError as exc:
                raise ValueError(
                    f"MegatronConfig.layer_spec={self.layer_spec!r} resolves to the transformer-engine spec "
                    f"on this GPU rank, but transformer_engine is not importable ({exc}); install "
                    "transformer-engine[pytorch] or set layer_spec='local'"
                ) from exc

    def data_parallel_size(self, world_size: int) -> int:
        ranks = self.ranks_per_replica
        if world_size % ranks:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {ranks}; change the world size "
                "or the parallel sizes (--megatron.tensor_model_parallel_size, --megatron.pipeline_model_parallel_size, "
                "--megatron.context_parallel_size)"
            )
        return world_size // ranks

    def validate_against_model(self, hf_config: Any, world_size: int) -> None:
        """Check the layout fits the model: heads % TP, kv heads % TP, layers % PP, world % (TP*PP)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        self.data_parallel_size(world_size)
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        layers = int(hf_config.num_hidden_layers)
        if heads % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads}; "
                "pick a TP size that divides the head count"
            )
        if kv_heads % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide num_key_value_heads={kv_heads} "
                "(KV-head replication is not implemented for the local spec); lower the TP size"
            )
        if layers % pp:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} must divide num_hidden_layers={layers}; "
                "pick a PP size that divides the layer count"
            )
        self._validate_experts(hf_config, world_size)
        vocab = int(hf_config.vocab_size)
        if vocab % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide vocab_size={vocab} (no vocab padding, "
                "so exported weights match the HF shapes); lower the TP size"
            )

    def _validate_experts(self, hf_config: Any, world_size: int) -> None:
        """The expert layout against the model: EP divides the experts, expert TP divides each expert's FFN, ETP x EP
        x PP divides the world (megatron-core's expert rank layout), MoE under TP has sequence parallelism; a dense
        model leaves every expert flag at its default."""
        tp, pp, ep, etp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                           self.expert_model_parallel_size, self.expert_tensor_parallel)
        experts = int(getattr(hf_config, "num_experts", None) or 0)  # qwen3_moe's name for the routed expert count
        if not experts:
            if ep > 1 or self.expert_tensor_parallel_size is not None or self.moe_aux_loss_coeff or self.moe_z_loss_coeff:
                raise ValueError(
                    f"{getattr(hf_config, 'model_type', 'this')} model has no routed experts: leave "
                    "--megatron.expert_model_parallel_size at 1, --megatron.expert_tensor_parallel_size unset and "
                    "--megatron.moe_aux_loss_coeff / moe_z_loss_coeff at 0")
            return
        if experts % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide num_experts={experts}; pick an EP size "
                             "that divides it")
        ffn = int(getattr(hf_config, "moe_intermediate_size", None) or 0)
        if ffn and ffn % etp:
            raise ValueError(f"expert tensor parallel size {etp} (--megatron.expert_tensor_parallel_size, unset = TP) "
                             f"must divide each expert's moe_intermediate_size={ffn}; pick a divisor")
        if tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"a mixture-of-experts model with tensor_model_parallel_size={tp} trains only with sequence parallelism "
                "(megatron-core's MoE layer refuses TP without it in training); set --megatron.sequence_parallel true")
        if ep == 1 and etp != tp:
            raise ValueError(
                f"expert tensor parallel size {etp} (--megatron.expert_tensor_parallel_size) differs from "
                f"tensor_model_parallel_size={tp} with expert_model_parallel_size=1: mbridge 0.15.1's export gathers "
                "experts that are not expert-parallel over the TP group, as TP shards; leave "
                "--megatron.expert_tensor_parallel_size unset or raise --megatron.expert_model_parallel_size")
        if world_size % (etp * ep * pp):
            dp = world_size // (tp * pp)
            same = (f"; with expert TP = TP, EP must divide the data-parallel size {dp}" if etp == tp else "")
            raise ValueError(
                f"expert_model_parallel_size={ep} x expert tensor parallel size {etp} "
                f"(--megatron.expert_tensor_parallel_size, unset = TP {tp}) x pipeline_model_parallel_size={pp} = "
                f"{etp * ep * pp} must divide the world size {world_size} (megatron-core lays expert ranks out as "
                f"ETP x EP x expert-DP x PP){same}; change --megatron.expert_model_parallel_size, "
                "--megatron.expert_tensor_parallel_size (1: whole experts, EP may then span the TP ranks) or the world size")
