"""The pad token's embedding row gets no gradient from its lookups, as in Hugging Face.

HF's Qwen2/Qwen3/Qwen3-MoE/Llama models build their input embedding as ``nn.Embedding(vocab, hidden,
padding_idx=config.pad_token_id)``: a lookup of the pad id adds nothing to that row's gradient. Megatron's
``VocabParallelEmbedding`` has no padding index, so a sequence that holds the pad id as an input token (an agent's
turn ends with ``<|endoftext|>``, Qwen's pad token, and the environment's reply follows it) trained the pad row on
Megatron and not on DeepSpeed/HF: on a tiny model whose pad row is zero, RMSNorm's backward at x = 0 made that one
row's gradient ~1e3 x the rest (grad norm 3185 vs 3.06 on an agent batch). The hook below keeps the forward values
and cuts the gradient at the pad positions; the output head's use of a tied weight is untouched (HF trains that
part of the row too).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def detach_pad_lookups(gpt: Any, pad_token_id: Optional[int]) -> None:
    """On the first pipeline stage (the one holding the input embedding) and when the HF config names a pad token,
    make the embedding's output at pad-id positions carry no gradient."""
    if pad_token_id is None or not getattr(gpt, "pre_process", False):
        return
    gpt.embedding.word_embeddings.register_forward_hook(_PadLookupHook(int(pad_token_id)))


class _PadLookupHook:
    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """``args[0]``: input ids ``[b, s]``; ``output``: ``[b, s, h]``, or ``[s/tp, b, h]`` when the embedding
        reduce-scatters into the sequence-parallel region (this rank's slice of the sequence)."""
        mask = args[0] == self.pad_token_id  # [b, s]
        if getattr(module, "reduce_scatter_embeddings", False):
            mask = mask.transpose(0, 1)  # [s, b]
            local = output.shape[0]
            rank = module.tp_group.rank() if getattr(module, "tp_group", None) is not None else 0
            mask = mask[rank * local : (rank + 1) * local]
        return torch.where(mask.unsqueeze(-1), output.detach(), output)
