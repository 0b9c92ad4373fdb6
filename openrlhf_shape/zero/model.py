"""The policy module a DeepSpeed engine wraps: a Hugging Face causal LM whose output layer is applied
by the chunked log-prob / entropy code, never as full logits.

``PolicyModule.forward(input_ids, position_ids, resp_rows, resp_pos, targets)`` runs the HF decoder
(``model.model``: embeddings, layers, final norm) on a micro-batch (``actor/batching.py``): packed, one
``[1, T]`` row whose position ids restart at 0 at every sample, which Hugging Face's attention turns into
document-causal attention (transformers' mask builder finds the samples from the position ids for the
``sdpa``/``eager``/``flex_attention`` masks; its flash-attention path runs flash-attn's varlen kernel, on
GPU, not run here); or padded ``[rows, seq]`` with causal attention. It picks the
hidden states that predict response tokens (``[N, h]``) and hands them with the output weight
``[V, h]`` to :func:`~openrlhf_shape.actor.logprobs.vocab_parallel_logprobs_entropy` (one vocab
shard: no TP group), which works in chunks of ``chunk_size`` positions so the largest float32
temporary is ``[chunk, V]`` and recomputes each chunk in backward.

Under ZeRO-3 the output weight is partitioned and gathered only around its owner's forward; the head
uses it outside that forward, so it is registered as an external parameter of the head (DeepSpeed
then gathers it around the head's forward and backward).
"""

from __future__ import annotations

import torch
from torch import nn

from openrlhf_shape.actor.logprobs import vocab_parallel_logprobs_entropy


# Hugging Face attention implementations that honour position-id packing (transformers 5: the mask
# builders of masking_utils for sdpa / eager / flex_attention, the varlen path of the flash-attention ones).
# Any other kernel would attend across samples: it gets padded micro-batches.
PACKING_ATTENTIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def packs_samples(attn_implementation: str) -> bool:
    """Whether micro-batches are packed into one row for this HF attention implementation."""
    return attn_implementation in PACKING_ATTENTIONS


class ChunkedLogprobHead(nn.Module):
    """Log-prob of the targets and full-vocab entropy from final hidden states, chunked over positions.

    Holds no parameters of its own: ``lm_head`` (the HF output layer, possibly tied to the input
    embedding) is referenced, not registered, so its weight keeps one owner and one HF name.
    """

    def __init__(self, lm_head: nn.Module, chunk_size: int):
        super().__init__()
        object.__setattr__(self, "_lm_head", lm_head)  # not a child module (one owner, one name)
        self.chunk_size = int(chunk_size)
        self.inv_temperature = 1.0

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[N, h]``, targets ``[N]`` -> (log-prob ``[N]`` float32, entropy ``[N]`` float32, no grad)."""
        weight = self._lm_head.weight
        return vocab_parallel_logprobs_entropy(
            hidden, weight, targets, vocab_start=0, temperature=1.0 / self.inv_temperature, tp_group=None,
            chunk_size=self.chunk_size, with_entropy=True,
        )


class PolicyModule(nn.Module):
    """HF causal LM + chunked head. Parameter names are the HF ones under ``hf.``."""

    def __init__(self, hf_model: nn.Module, chunk_size: int):
        super().__init__()
        self.hf = hf_model
        self.head = ChunkedLogprobHead(hf_model.get_output_embeddings(), chunk_size)

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, resp_rows: torch.Tensor,
                resp_pos: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids``/``position_ids`` ``[rows, seq]`` (packed: ``[1, T]``); ``resp_rows``/``resp_pos``/``targets`` ``[N]``.

        No attention mask: padded, right padding and causal attention keep pads out of every real position;
        packed, the restarting position ids make the attention document-causal."""
        hidden = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        h = hidden[resp_rows, resp_pos]  # [N, h]
        return self.head(h, targets)


def load_hf_model(hf_dir: str, *, dtype: torch.dtype, attn_implementation: str, gradient_checkpointing: bool):
    """The HF causal LM in ``dtype`` with every parameter trainable (weights from ``hf_dir``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation=attn_implementation)
    with torch.no_grad():  # own storage, not a view of the memory-mapped checkpoint: colocation frees storages
        for p in model.parameters():
            if not p.untyped_storage().resizable():
                p.data = p.data.clone()
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def register_head_weight(policy: PolicyModule) -> None:
    """ZeRO-3: the head reads the output weight outside its owner's forward (DeepSpeed must gather it)."""
    import deepspeed

    deepspeed.zero.register_external_parameter(policy.head, policy.head._lm_head.weight)


def hf_named_parameters(policy: PolicyModule) -> list[tuple[str, nn.Parameter]]:
    """(HF name, parameter) of the wrapped model; tied weights once, under their first owner's name
    (``model.embed_tokens.weight`` for a tied output layer, as the Megatron export names it)."""
    return list(policy.hf.named_parameters())
