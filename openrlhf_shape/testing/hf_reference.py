"""What Hugging Face computes on given weights: the reference an engine's log-probs are held to."""

from __future__ import annotations

import os

import torch


def hf_token_logprobs(model_dir: str | os.PathLike, weights: dict[str, torch.Tensor] | None,
                      sequences: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence of L tokens, the [L - 1] float32 log-probs of tokens[1:] under the model in
    ``model_dir`` with ``weights`` (HF names; None = the directory's own) loaded on top, at
    ``temperature``. A tied model's head follows its embedding, as in the trainer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
            raise ValueError(f"weights do not fit {model_dir}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.long)
            logits = model(ids).logits[0, :-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def mean_abs_gap(engine: list[list[float]], reference: list[torch.Tensor]) -> float:
    """Mean |engine - reference| over every token of every sequence (nats)."""
    diffs = [torch.tensor(e, dtype=torch.float32) - r for e, r in zip(engine, reference, strict=True)]
    return float(torch.cat([d.abs() for d in diffs]).mean())
