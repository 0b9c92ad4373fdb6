"""A plain Hugging Face forward as the log-prob/entropy actor (light tests and tools, no ranks)."""

from __future__ import annotations

import torch

from openrlhf_shape.algorithms.entropy import token_log_probs_and_entropy
from openrlhf_shape.batch import LogProbs, SequenceBatch


class HFActor:
    """Same contract as the rank group's ``compute_logprobs_and_entropy`` at world size 1 (float32, one
    sample at a time; the vocabulary in chunks of ``chunk_size`` rows)."""

    def __init__(self, model_dir: str, chunk_size: int = 256):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.chunk_size = chunk_size

    @torch.no_grad()
    def compute_logprobs_and_entropy(self, batch: SequenceBatch) -> LogProbs:
        """Each response token's log-prob and entropy ``[T_i]`` at ``batch.temperature``."""
        batch = SequenceBatch.coerce(batch)
        log_probs, entropy = [], []
        for seq, plen in zip(batch.sequences, batch.prompt_lens):
            ids = torch.tensor(seq)[None]
            logits = self.model(ids).logits[0, plen - 1 : len(seq) - 1]
            lp, ent = token_log_probs_and_entropy(logits, ids[0, plen:], float(batch.temperature), self.chunk_size)
            log_probs.append(lp)
            entropy.append(ent)
        return LogProbs(log_probs=log_probs, entropy=entropy)
