"""Seeding and the host-side random-number state a checkpoint saves per rank, so a resumed run draws what the
uninterrupted one would have: Python's ``random``, torch's CPU generator, numpy's (when installed) and,
on a GPU profile, the current CUDA device's generator. Backends add their own (Megatron: its CUDA RNG
tracker) on top."""

from __future__ import annotations

import random

import torch


def capture_rng(on_gpu: bool) -> dict:
    """The generators' states as a picklable dict (``on_gpu``: the rank's ``Platform.on_gpu``)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    return state


def restore_rng(state: dict, on_gpu: bool) -> None:
    """Set the generators from :func:`capture_rng`'s dict (a CUDA state is applied only on a GPU profile)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and on_gpu:
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, torch (CPU, and CUDA through ``torch.manual_seed``) and numpy (mod 2**32)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
