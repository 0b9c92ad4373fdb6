"""Full-vocabulary token entropy and log-probs, in float32, chunked over tokens.

A [tokens, vocab] batch of logits in bf16 at vocab 151936 is ~0.3 MB per token; a float32 copy of
the whole batch would double or triple that. Both functions here upcast one chunk of rows at a time,
so the float32 scratch is bounded by ``chunk_size * vocab * 4`` bytes (a few of them).
"""

from __future__ import annotations

import torch

# Default float32 scratch budget per chunk when ``chunk_size`` is None (bytes).
_DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


def _check_logits(logits: torch.Tensor, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty vocab (last) dimension, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _auto_chunk(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, _DEFAULT_CHUNK_BYTES // (4 * vocab))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None (automatic), got {chunk_size}")
    return int(chunk_size)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits / temperature), in nats.

    Args:
        logits: ``[..., vocab]`` in any float dtype.
        temperature: the sampling temperature (> 0); entropy is that of the sampling distribution.
        chunk_size: rows (flattened leading positions) upcast to float32 at a time; None picks a
            chunk with at most ~64 MiB of float32 scratch.

    Returns:
        ``[...]`` float32 entropies (the leading shape of ``logits``); a statistic, not differentiable.
    """
    _check_logits(logits, temperature)
    lead = logits.shape[:-1]
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = _auto_chunk(vocab, chunk_size)
    inv_t = 1.0 / float(temperature)
    for start in range(0, flat.shape[0], step):
        z = flat[start : start + step].float() * inv_t
        log_z = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        # H = log Z - E_p[z]
        out[start : start + step] = log_z - (p * z).sum(-1)
    return out.reshape(lead)


def token_log_probs_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``token_ids`` and full-vocab entropy under softmax(logits / temperature).

    Args:
        logits: ``[..., vocab]``; token_ids: ``[...]`` integer ids (same leading shape).
    Returns:
        (log_probs ``[...]`` float32, entropy ``[...]`` float32). Differentiable w.r.t. logits for log-probs.
    """
    _check_logits(logits, temperature)
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits' leading shape {tuple(logits.shape[:-1])}"
        )
    vocab = logits.shape[-1]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}), got range [{int(token_ids.min())}, {int(token_ids.max())}]")
    flat = logits.reshape(-1, vocab)
    ids = token_ids.reshape(-1)
    step = _auto_chunk(vocab, chunk_size)
    inv_t = 1.0 / float(temperature)
    lps, ents = [], []
    for start in range(0, flat.shape[0], step):
        z = flat[start : start + step].float() * inv_t
        log_z = torch.logsumexp(z, dim=-1)
        lps.append(z.gather(-1, ids[start : start + step, None]).squeeze(-1) - log_z)
        with torch.no_grad():
            p = torch.softmax(z.detach(), dim=-1)
            ents.append(log_z.detach() - (p * z.detach()).sum(-1))
    lead = logits.shape[:-1]
    if not lps:
        empty = torch.zeros(lead, dtype=torch.float32, device=logits.device)
        return empty, empty.clone()
    return torch.cat(lps).reshape(lead), torch.cat(ents).reshape(lead)
