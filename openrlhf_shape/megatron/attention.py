"""Core attention for Megatron's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` computes the raw scores [batch*heads, s, s] into a
persistent buffer and runs the softmax on them (in float32 when ``attention_softmax_in_fp32``):
at 16k tokens and 32 heads that is 17 GB (bf16 scores) plus 34 GB (float32 softmax) per layer.
:class:`SdpaCoreAttention` is a drop-in replacement (same constructor and forward signature) that
calls torch's fused attention instead (flash / memory-efficient kernels on GPU, O(s) memory).

Masking: our micro-batches are right-padded and the model is always called with
``attention_mask=None`` and the causal mask type (see ``batching.build_micro_batch``); a real
token never attends to a later position, so causal attention alone is exact for every real
token, and pad positions never feed a real token's output. Padding masks, sliding windows,
attention sinks, attention bias, packed sequences and context parallelism are refused.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F


def _megatron_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SdpaCoreAttention(_megatron_base()):  # type: ignore[misc]
    """Causal self-attention core: q [s, b, np, hn], k/v [s, b, ng, hn] -> context [s, b, np*hn].

    ``np``/``ng``: query heads / KV groups on this TP rank (GQA handled by SDPA's ``enable_gqa``).
    Softmax scale: ``softmax_scale`` or 1/sqrt(hn), divided by the layer number when
    ``apply_query_key_layer_scaling`` (as Megatron's DotProductAttention does).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError(
                "local_attention='sdpa' does not support context parallelism; set context_parallel_size=1"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"local_attention='sdpa' supports causal self-attention only, got {attn_mask_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("local_attention='sdpa' does not implement sliding-window attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("local_attention='sdpa' supports the vanilla softmax only")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.hidden_per_partition = self.heads_per_partition * head_dim
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        if config.apply_query_key_layer_scaling:
            scale /= self.layer_number
        self.softmax_scale = scale
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "local_attention='sdpa' expects right-padded micro-batches with no attention mask, bias or "
                "packed-sequence params (causal masking only)"
            )
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            from megatron.core import tensor_parallel

            # same RNG stream as Megatron's attention dropout without sequence parallel
            ctx = (
                tensor_parallel.get_cuda_rng_tracker().fork()
                if not self.config.sequence_parallel
                else contextlib.nullcontext()
            )
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                enable_gqa=self.heads_per_partition != self.groups_per_partition,
            )
        # [b, heads, s, hn] -> [s, b, heads*hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_per_partition)


def local_layer_spec(*, qk_layernorm: bool, attention: str, num_experts: int | None = None):
    """Megatron's local GPT layer spec (RMSNorm) with the chosen core attention ("megatron" | "sdpa").
    ``num_experts``: a MoE layer whose experts are Megatron's ``SequentialMLP`` (one local MLP per expert;
    grouped GEMM needs transformer-engine or the CUDA grouped_gemm package)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    elif attention != "megatron":
        raise ValueError(f"local attention must be 'megatron' or 'sdpa', got {attention!r}")
    return spec
