"""What a pass allocates in the shape of logits: the most rows any operation produced with ``vocab`` columns.

The chunked log-prob / entropy head (``actor/logprobs.py``) must never hold ``[tokens, vocab]`` for a whole
micro-batch: its largest logits-shaped tensor has ``chunk_size`` rows (``[chunk, V/tp]`` under tensor
parallelism), forward and backward. :class:`LogitsWatch` is a ``TorchDispatchMode`` that sees every tensor
an operation returns (views left out: a view allocates nothing, and the output weight's transpose
``[h, V]`` is one) and keeps the largest row count among those whose last dimension is ``vocab``. Used by
the backends' packing tests on the real ranks (tests/megatron, tests/zero).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LogitsWatch(TorchDispatchMode):
    """``max_rows``: the most rows (product of all but the last dimension) of any non-view tensor with
    ``vocab`` columns that an operation returned inside the ``with`` block (0 when none)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = int(vocab)
        self.max_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and not t._is_view()):
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
        return out
