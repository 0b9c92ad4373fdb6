"""Core attention for Megatron's local layer spec, and packed (THD) micro-batches on it.

Megatron's local ``DotProductAttention`` computes the raw scores [batch*heads, s, s] into a
persistent buffer and runs the softmax on them (in float32 when ``attention_softmax_in_fp32``):
at 16k tokens and 32 heads that is 17 GB (bf16 scores) plus 34 GB (float32 softmax) per layer.
:class:`SdpaCoreAttention` is a drop-in replacement (same constructor and forward signature) that
calls torch's fused attention instead (flash / memory-efficient kernels on GPU, O(s) memory).

Masking. A padded micro-batch (``actor/batching.py``) is right-padded and the model is called with
``attention_mask=None`` and the causal mask type: a real token never attends to a later position, so
causal attention alone is exact for every real token, and pad positions never feed a real token's
output. A packed micro-batch is one row of several samples (THD: ``query`` ``[t, heads, hn]``) with
``PackedSeqParams`` (``cu_seqlens``): attention is document-causal, a token sees the earlier tokens of
its own sample only. Both local attentions here take it: :class:`PackedDotProductAttention` (Megatron's
own arithmetic, run per document) and :class:`SdpaCoreAttention` (per document through torch SDPA, the
CPU twin; or flash-attn's ``flash_attn_varlen_func`` over the whole pack when the rank's platform
profile says GPU and flash-attn is installed: :func:`varlen_kernel`). Under the transformer-engine spec
TE's ``DotProductAttention`` takes the same ``PackedSeqParams`` (``qkv_format="thd"``, as
megatron-core 0.16's ``TEDotProductAttention`` forwards them). The flash-attn and TE paths are written
against their source and have not run here (no GPU). Padding masks, sliding windows, attention sinks,
attention bias and context parallelism are refused.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from openrlhf_shape.platform import Platform

VARLEN_KERNELS = ("torch", "flash_attn")


def _megatron_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


def _packed_seq_params_base():
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams


def _dot_product_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


@dataclass
class ShapePackedSeqParams(_packed_seq_params_base()):  # type: ignore[misc]
    """megatron-core's ``PackedSeqParams`` (THD) plus what our local attentions read: the document
    boundaries on the host (no device sync to split a pack) and the varlen kernel the platform chose.
    megatron-core's TE attention forwards only the base class's fields to TE."""

    cu_seqlens_host: tuple[int, ...] = field(default=())
    varlen_kernel: str = "torch"


def varlen_kernel(platform: Platform) -> str:
    """The kernel of :class:`SdpaCoreAttention` for a packed micro-batch: flash-attn's varlen kernel on a GPU
    rank that has flash-attn installed, else torch SDPA per document (the CPU twin; also a GPU without flash-attn)."""
    if platform.on_gpu and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    return "torch"


def packed_seq_params(cu_seqlens: list[int], *, device: torch.device, kernel: str = "torch") -> ShapePackedSeqParams:
    """THD parameters of one packed micro-batch: ``cu_seqlens`` ``[0, l_0, l_0 + l_1, ..., T]`` (documents,
    a padding tail included), int32 on ``device`` as TE and flash-attn want them."""
    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"varlen kernel must be one of {VARLEN_KERNELS}, got {kernel!r}")
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    if not lengths or min(lengths) < 1 or cu_seqlens[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly, got {cu_seqlens}")
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    return ShapePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                max_seqlen_kv=max(lengths), cu_seqlens_host=tuple(cu_seqlens), varlen_kernel=kernel)


def _documents(params: Any) -> list[tuple[int, int]]:
    """``(start, end)`` of every document of a THD micro-batch."""
    if getattr(params, "qkv_format", None) != "thd":
        raise ValueError(f"packed micro-batches must be THD (qkv_format='thd'), got {getattr(params, 'qkv_format', None)!r}")
    if getattr(params, "cu_seqlens_q_padded", None) is not None or getattr(params, "cp_group", None) is not None:
        raise ValueError("the local attentions take unpadded documents without context parallelism "
                         "(cu_seqlens_q_padded and cp_group must be None)")
    cu = list(getattr(params, "cu_seqlens_host", ())) or params.cu_seqlens_q.tolist()
    return list(zip(cu[:-1], cu[1:]))


class PackedDotProductAttention(_dot_product_attention_base()):  # type: ignore[misc]
    """Megatron's local ``DotProductAttention`` that also takes a packed (THD) micro-batch: each document runs
    through Megatron's own causal arithmetic on its own, which is document-causal attention over the pack.
    Padded micro-batches go to the parent unchanged."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        """Padded: as Megatron's. Packed: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, 1, np*hn]``."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("a packed micro-batch takes no attention mask or bias (document-causal by cu_seqlens)")
        outs = [super(PackedDotProductAttention, self).forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1),
                                                               value[a:b].unsqueeze(1), None, attn_mask_type)
                for a, b in _documents(packed_seq_params)]
        return torch.cat(outs, dim=0)


class SdpaCoreAttention(_megatron_base()):  # type: ignore[misc]
    """Causal self-attention core: q [s, b, np, hn], k/v [s, b, ng, hn] -> context [s, b, np*hn]; packed (THD):
    q [t, np, hn], k/v [t, ng, hn] -> [t, 1, np*hn], attention inside each document.

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
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "local_attention='sdpa' expects micro-batches with no attention mask or bias (right-padded and "
                "causal, or packed and document-causal through packed_seq_params)"
            )
        with self._dropout_rng():
            if packed_seq_params is None:
                return self._attend(query, key, value)
            if getattr(packed_seq_params, "varlen_kernel", "torch") == "flash_attn":
                return self._flash_varlen(query, key, value, packed_seq_params)
            docs = _documents(packed_seq_params)
            return torch.cat([self._attend(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1))
                              for a, b in docs], dim=0)

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _dropout_rng(self):
        """Megatron's RNG stream for attention dropout without sequence parallel (as its DotProductAttention)."""
        if self._dropout_p() > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """q [s, b, np, hn], k/v [s, b, ng, hn] -> causal attention [s, b, np*hn]."""
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self._dropout_p(), is_causal=True, scale=self.softmax_scale,
            enable_gqa=self.heads_per_partition != self.groups_per_partition,
        )
        # [b, heads, s, hn] -> [s, b, heads*hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_per_partition)

    def _flash_varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """GPU: flash-attn's varlen kernel over the whole pack (q [t, np, hn], k/v [t, ng, hn]; GQA native;
        causal within each document; int32 cu_seqlens on the device). Written against flash-attn 2's
        ``flash_attn_varlen_func``; not run here (no GPU)."""
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(query, key, value, params.cu_seqlens_q, params.cu_seqlens_kv,
                                     params.max_seqlen_q, params.max_seqlen_kv, dropout_p=self._dropout_p(),
                                     softmax_scale=self.softmax_scale, causal=True)
        return out.reshape(out.shape[0], 1, self.hidden_per_partition)


def local_layer_spec(*, qk_layernorm: bool, attention: str, num_experts: int | None = None):
    """Megatron's local GPT layer spec (RMSNorm) with the chosen core attention ("megatron": Megatron's own,
    packed micro-batches run per document | "sdpa").
    ``num_experts``: a MoE layer whose experts are Megatron's ``SequentialMLP`` (one local MLP per expert;
    grouped GEMM needs transformer-engine or the CUDA grouped_gemm package)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    if attention not in ("megatron", "sdpa"):
        raise ValueError(f"local attention must be 'megatron' or 'sdpa', got {attention!r}")
    # Megatron's DotProductAttention refuses packed micro-batches; its subclass here runs them per document.
    core = SdpaCoreAttention if attention == "sdpa" else PackedDotProductAttention
    spec.submodules.self_attention.submodules.core_attention = core
    return spec
