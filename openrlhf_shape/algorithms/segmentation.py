"""Segment boundaries for a response: entropy-based (EBS), uniform and delimiter (ablations).

A boundary ``b`` (``1 <= b <= T-1``) splits a response ``y[0..T-1]`` into ``y[:b] | y[b:]``; the state
at the boundary is prompt + ``y[:b]``. Interior boundaries are returned sorted and unique; the
closing boundaries 0 and T are implicit. ``T`` is the number of valid (mask == True) tokens, which
must form a prefix of the row (right padding).

Downsampling (docs/architecture.md): for ``j = 1..K-1`` take the unused candidate nearest to
``j*T/K`` (ties: the earlier position) that keeps at least ``min_segment_len`` tokens between it and
every boundary already chosen, and between it and both ends. Fewer candidates give fewer segments;
no boundary is ever placed at a non-candidate position.

The modes (``--shape.segmentation``) differ only in their candidates; each is a :class:`Segmentation` registered by
name in :data:`SEGMENTATIONS`, the one list of them. A new mode is one module: subclass it, decorate it with
``@register_segmentation("name")``, and import the module before the run.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol

import torch


class ShapeConfig(Protocol):
    """What a segmentation mode reads of ``--shape.*`` (``algorithms/config.py``'s ``ShapeConfig``, which imports
    this module to check ``segmentation`` against :data:`SEGMENTATIONS`)."""

    segmentation: str
    num_segments: int  # K
    entropy_threshold: float | None
    entropy_quantile: float
    min_segment_len: int
    delimiter: str

PAD_BOUNDARY = -1  # padding value in batched boundary tensors
SEGMENTATIONS: dict[str, type["Segmentation"]] = {}


def register_segmentation(name: str) -> Callable[[type["Segmentation"]], type["Segmentation"]]:
    """Class decorator: make a segmentation mode available as ``--shape.segmentation name``."""

    def wrap(cls: type["Segmentation"]) -> type["Segmentation"]:
        if name in SEGMENTATIONS:
            raise ValueError(f"segmentation {name!r} is registered twice")
        cls.name = name
        SEGMENTATIONS[name] = cls
        return cls

    return wrap


class Segmentation:
    """A segmentation mode: which positions of a batch may be boundaries (:meth:`candidates`). Bound to a run once
    by :func:`get_segmentation`, where a mode prepares what it reads (the delimiter's token ids from the tokenizer);
    ``needs_token_ids``: its candidates read the responses' token ids. Called on a batch it returns the boundaries
    ``[B, K-1]`` (sorted, -1 padded): the candidates downsampled by the one rule of :func:`select_cutpoints_batched`."""

    name: ClassVar[str] = ""
    needs_token_ids: ClassVar[bool] = False

    def __init__(self, cfg: "ShapeConfig", tokenizer: Any = None):
        self.cfg = cfg

    def candidates(self, entropy: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """``[B, T]`` bool from the entropy ``[B, T]``, the right-padded mask ``[B, T]`` and the token ids (or None)."""
        raise NotImplementedError

    def __call__(self, entropy: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if entropy.dim() != 2 or mask.shape != entropy.shape:
            raise ValueError(f"entropy and mask must be [B, T] of one shape, got {tuple(entropy.shape)} and "
                             f"{tuple(mask.shape)}")
        if self.needs_token_ids and token_ids is None:
            raise ValueError(f"--shape.segmentation {self.name} needs the responses' token ids")
        mask = mask.bool()
        lengths = _valid_lengths(mask)
        _check_nonempty(lengths)
        cand = self.candidates(entropy, mask, token_ids)
        return select_cutpoints_batched(cand, lengths, self.cfg.num_segments, self.cfg.min_segment_len)


def get_segmentation(cfg: "ShapeConfig", tokenizer: Any = None) -> Segmentation:
    """The mode ``cfg.segmentation`` (``--shape.segmentation``, checked by ``ShapeConfig``) bound to ``cfg`` and the
    policy's ``tokenizer`` (needed only by modes that read token ids)."""
    return SEGMENTATIONS[cfg.segmentation](cfg, tokenizer)


def _valid_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` [B, T] bool, right-padded -> lengths [B]; raises if a row has holes."""
    lengths = mask.sum(-1)
    pos = torch.arange(mask.shape[-1], device=mask.device)
    expected = pos[None, :] < lengths[:, None]
    if not torch.equal(expected, mask):
        bad = int((expected != mask).any(-1).nonzero()[0])
        raise ValueError(
            f"mask row {bad} is not right-padded (valid tokens must be a prefix of the row); "
            "segmentation needs contiguous responses"
        )
    return lengths


def _check_2d(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, tokens], got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must equal {shape}")


def _check_common(num_segments: int, min_segment_len: int) -> None:
    if int(num_segments) < 1:
        raise ValueError(f"num_segments (K) must be >= 1, got {num_segments}")
    if int(min_segment_len) < 1:
        raise ValueError(f"min_segment_len must be >= 1, got {min_segment_len}")


def _check_nonempty(lengths: torch.Tensor) -> None:
    if lengths.numel() and int(lengths.min()) < 1:
        row = int((lengths < 1).nonzero()[0])
        raise ValueError(f"response {row} is empty (no valid tokens): it cannot be segmented")


def select_cutpoints_batched(
    candidates: torch.Tensor, lengths: torch.Tensor, num_segments: int, min_segment_len: int = 1
) -> torch.Tensor:
    """Downsample candidate boundaries to at most ``num_segments - 1`` per row.

    Args:
        candidates: ``[B, T]`` bool; ``candidates[i, b]`` marks b as an allowed boundary.
        lengths: ``[B]`` valid response lengths (T_i >= 1).
        num_segments: K, the maximum number of segments.
        min_segment_len: minimum tokens in every segment (including first and last).

    Returns:
        ``[B, K-1]`` long, each row sorted ascending with its boundaries first and
        ``PAD_BOUNDARY`` (-1) after them.
    """
    _check_common(num_segments, min_segment_len)
    batch, width = candidates.shape
    k_minus_1 = int(num_segments) - 1
    if k_minus_1 == 0 or batch == 0 or width == 0:
        return torch.full((batch, max(k_minus_1, 0)), PAD_BOUNDARY, dtype=torch.long, device=candidates.device)
    device = candidates.device
    pos = torch.arange(width, device=device)
    lengths = lengths.to(device).long()
    # Allowed: a candidate with at least min_segment_len tokens on each side within [0, T_i].
    available = (
        candidates.bool()
        & (pos[None, :] >= min_segment_len)
        & (pos[None, :] <= lengths[:, None] - min_segment_len)
    )
    # Compact each row's allowed positions into [B, C] (C = the largest count) so the greedy loop
    # below touches ~20% of the tokens instead of all of them. Empty slots hold `width` (never chosen).
    rows, cols_idx = available.nonzero(as_tuple=True)  # row-major: positions ascending per row
    counts = torch.bincount(rows, minlength=batch)
    cols = max(int(counts.max()) if counts.numel() else 0, 1)
    row_start = counts.cumsum(0) - counts
    slot = torch.arange(rows.numel(), device=device) - row_start[rows]
    cand_pos = torch.full((batch, cols), width, dtype=torch.long, device=device)
    cand_pos[rows, slot] = cols_idx
    free = cand_pos < width
    cand_f = cand_pos.to(torch.float32)
    big = float(2 * width + 2)
    chosen = torch.full((batch, k_minus_1), PAD_BOUNDARY, dtype=torch.long, device=device)
    for j in range(1, k_minus_1 + 1):
        target = lengths.to(torch.float32) * (j / float(num_segments))  # [B]
        dist = torch.where(free, (cand_f - target[:, None]).abs(), torch.full_like(cand_f, big))
        best_dist, best_slot = dist.min(dim=-1)  # first slot on ties = earlier position
        ok = best_dist < big
        best = cand_pos.gather(1, best_slot[:, None]).squeeze(1)
        chosen[:, j - 1] = torch.where(ok, best, torch.full_like(best, PAD_BOUNDARY))
        near = (cand_pos - best[:, None]).abs() < min_segment_len
        free &= ~(near & ok[:, None])
    # Sort each row ascending with padding (-1) moved to the end.
    key = torch.where(chosen >= 0, chosen, torch.full_like(chosen, width + 1))
    sorted_key, _ = key.sort(dim=-1)
    return torch.where(sorted_key <= width, sorted_key, torch.full_like(sorted_key, PAD_BOUNDARY))


def entropy_candidates_batched(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    threshold: float | None = None,
    quantile: float = 0.8,
) -> torch.Tensor:
    """Candidate boundaries ``[B, T]`` bool: valid positions b >= 1 with ``entropy[b] > tau``.

    ``tau`` is ``threshold`` when given, else the per-response ``quantile`` of the valid entropies
    (linear interpolation, as ``torch.quantile``). Raises on NaN/inf entropy at valid positions.
    """
    _check_2d("entropy", entropy)
    _check_2d("mask", mask, tuple(entropy.shape))
    mask = mask.bool()
    ent = entropy.to(torch.float32)
    if not torch.isfinite(ent[mask]).all():
        row = int((~torch.isfinite(ent) & mask).any(-1).nonzero()[0])
        raise ValueError(f"entropy of response {row} has NaN/inf at a valid position: check the log-prob pass")
    lengths = _valid_lengths(mask)
    if threshold is not None:
        tau = torch.full((ent.shape[0],), float(threshold), dtype=torch.float32, device=ent.device)
    else:
        if not 0.0 <= float(quantile) <= 1.0:
            raise ValueError(f"quantile must lie in [0, 1], got {quantile}")
        # Quantile q of the n valid values (linear interpolation between order statistics lo and
        # hi = lo + 1) without sorting whole rows: both statistics lie in the top
        # (1 - q)(n - 1) + 2 values, which topk finds in a fraction of a full sort's time.
        n = lengths.clamp(min=1)
        pos = float(quantile) * (n - 1).to(torch.float32)
        lo = pos.floor().long()
        hi = pos.ceil().long()
        k_top = min(ent.shape[-1], int(((n - 1) - lo).max()) + 1 if n.numel() else 1)
        filled = torch.where(mask, ent, torch.full_like(ent, float("-inf")))
        top, _ = filled.topk(k_top, dim=-1, largest=True, sorted=True)  # descending
        v_lo = top.gather(1, ((n - 1) - lo)[:, None]).squeeze(1)
        v_hi = top.gather(1, ((n - 1) - hi)[:, None]).squeeze(1)
        tau = v_lo + (v_hi - v_lo) * (pos - lo.to(torch.float32))
    width = ent.shape[-1]
    posi = torch.arange(width, device=ent.device)
    return mask & (ent > tau[:, None]) & (posi[None, :] >= 1)


def entropy_cutpoints(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    num_segments: int,
    threshold: float | None = None,
    quantile: float = 0.8,
    min_segment_len: int = 8,
) -> torch.Tensor:
    """Entropy-based segmentation (EBS) of one response.

    Args:
        entropy: ``[T]`` token entropies H_t (nats); mask: ``[T]`` bool, valid tokens first.
        num_segments: K (at most K-1 interior boundaries).
        threshold: absolute tau; when None, tau is the per-response ``quantile`` of H
            (default 0.8: the top 20% entropy tokens are candidates).
        min_segment_len: minimum tokens per segment.

    Returns:
        LongTensor ``[n]``, ``n <= K-1``: sorted unique boundaries b with ``0 < b < T`` and
        ``entropy[b] > tau``.
    """
    if not isinstance(entropy, torch.Tensor) or entropy.dim() != 1:
        raise ValueError(f"entropy must be a 1-D tensor [T], got {getattr(entropy, 'shape', type(entropy))}")
    if not isinstance(mask, torch.Tensor) or mask.shape != entropy.shape:
        raise ValueError(f"mask must be a tensor with the shape of entropy {tuple(entropy.shape)}")
    _check_common(num_segments, min_segment_len)
    lengths = _valid_lengths(mask[None].bool())
    _check_nonempty(lengths)
    cand = entropy_candidates_batched(entropy[None], mask[None], threshold=threshold, quantile=quantile)
    out = select_cutpoints_batched(cand, lengths, num_segments, min_segment_len)[0]
    return out[out >= 0]


def uniform_cutpoints(length: int, num_segments: int, min_segment_len: int = 1) -> torch.Tensor:
    """Ablation (w/o EBS): K segments of (nearly) equal length; fewer when T < K * min_segment_len.

    Returns LongTensor of sorted interior boundaries ``round(j*T/K)``, deduplicated.
    """
    _check_common(num_segments, min_segment_len)
    length = int(length)
    if length < 1:
        raise ValueError("cannot segment an empty response (length 0)")
    k = max(1, min(int(num_segments), length // int(min_segment_len)))
    b = torch.tensor([round(j * length / k) for j in range(1, k)], dtype=torch.long)
    b = b[(b > 0) & (b < length)]
    return torch.unique(b)


def delimiter_candidates(token_ids: torch.Tensor, delimiter_token_ids: set[int] | torch.Tensor) -> torch.Tensor:
    """Candidates for delimiter segmentation: b where token ``y[b-1]`` is a delimiter token.

    Args:
        token_ids: ``[..., T]`` ids; delimiter_token_ids: ids whose text ends a step (e.g. contain "\\n\\n").
    Returns: ``[..., T]`` bool.
    """
    ids = torch.as_tensor(sorted(delimiter_token_ids) if isinstance(delimiter_token_ids, set) else delimiter_token_ids)
    is_delim = torch.isin(token_ids, ids.to(token_ids.device))
    cand = torch.zeros_like(is_delim)
    cand[..., 1:] = is_delim[..., :-1]
    return cand


def delimiter_token_ids(tokenizer: Any, delimiter: str) -> set[int]:
    """Ids whose decoded text contains ``delimiter`` (the delimiter mode's candidates follow them)."""
    ids = {tok_id for tok_id in range(len(tokenizer)) if delimiter in tokenizer.decode([tok_id])}
    if not ids:
        raise ValueError(f"no token of this vocabulary contains the delimiter {delimiter!r} (--shape.delimiter)")
    return ids


def delimiter_cutpoints(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    delimiter_token_ids: set[int] | torch.Tensor,
    num_segments: int,
    min_segment_len: int = 8,
) -> torch.Tensor:
    """Ablation (w/o EBS): boundaries right after delimiter tokens, downsampled like EBS. ``[T]`` -> ``[n]``."""
    if token_ids.dim() != 1 or mask.shape != token_ids.shape:
        raise ValueError("token_ids and mask must be 1-D tensors [T] of the same shape")
    lengths = _valid_lengths(mask[None].bool())
    _check_nonempty(lengths)
    cand = delimiter_candidates(token_ids[None], delimiter_token_ids) & mask[None].bool()
    out = select_cutpoints_batched(cand, lengths, num_segments, min_segment_len)[0]
    return out[out >= 0]


def boundaries_to_segment_ids(boundaries: torch.Tensor, width: int) -> torch.Tensor:
    """Segment index of each token: ``segment_ids[t] = #{b in boundaries : b <= t}``.

    Args:
        boundaries: ``[n]`` sorted interior boundaries, or ``[B, K-1]`` padded with -1.
        width: number of token positions T (padded width for batches).
    Returns: ``[T]`` or ``[B, T]`` long.
    """
    pos = torch.arange(int(width), device=boundaries.device)
    if boundaries.dim() == 1:
        return (boundaries[None, :] <= pos[:, None]).sum(-1) if boundaries.numel() else torch.zeros_like(pos)
    if boundaries.dim() != 2:
        raise ValueError(f"boundaries must be [n] or [B, K-1], got shape {tuple(boundaries.shape)}")
    # Sorted rows with padding pushed past the end; searchsorted(right=True) counts b <= t.
    padded = torch.where(boundaries >= 0, boundaries, torch.full_like(boundaries, int(width) + 1)).contiguous()
    return torch.searchsorted(padded, pos[None, :].expand(padded.shape[0], -1).contiguous(), right=True)


def segment_lengths(boundaries: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths of every segment for padded batched boundaries.

    Args:
        boundaries: ``[B, K-1]`` (sorted, -1 padded); lengths: ``[B]`` response lengths T_i.
    Returns:
        (seg_lengths ``[B, K]`` long with 0 for absent segments, num_segments ``[B]`` long).
    """
    batch, km1 = boundaries.shape
    n_b = (boundaries >= 0).sum(-1)
    num_segments = n_b + 1
    # edges: 0, b_1..b_n, T, then padding repeats T so padded lengths are 0.
    lengths = lengths.long()
    edges = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=boundaries.device), boundaries,
                       lengths[:, None]], dim=1)
    idx = torch.arange(km1 + 2, device=boundaries.device)
    interior = (idx[None, :] >= 1) & (idx[None, :] <= km1)
    is_pad = interior & (edges < 0)
    edges = torch.where(is_pad, lengths[:, None].expand_as(edges), edges)
    # padding sits after valid boundaries, so edges are non-decreasing with T repeated.
    return edges[:, 1:] - edges[:, :-1], num_segments


@register_segmentation("entropy")
class EntropySegmentation(Segmentation):
    """EBS (the paper): positions whose entropy exceeds ``--shape.entropy_threshold``, else the response's
    ``--shape.entropy_quantile``."""

    def candidates(self, entropy: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        return entropy_candidates_batched(entropy, mask, self.cfg.entropy_threshold, self.cfg.entropy_quantile)


@register_segmentation("uniform")
class UniformSegmentation(Segmentation):
    """Ablation (w/o EBS): every position is a candidate; the one nearest j*T/K wins, so segments are equal."""

    def candidates(self, entropy: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        cand = mask.clone()
        cand[:, 0] = False
        return cand


@register_segmentation("delimiter")
class DelimiterSegmentation(Segmentation):
    """Ablation (w/o EBS): positions right after a token whose text contains ``--shape.delimiter``."""

    needs_token_ids = True

    def __init__(self, cfg: "ShapeConfig", tokenizer: Any = None):
        super().__init__(cfg, tokenizer)
        if tokenizer is None:
            raise ValueError("--shape.segmentation delimiter needs the policy's tokenizer (the delimiter's token ids)")
        self.delimiter_ids = delimiter_token_ids(tokenizer, cfg.delimiter)

    def candidates(self, entropy: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        return delimiter_candidates(token_ids, self.delimiter_ids) & mask
