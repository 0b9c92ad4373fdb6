"""The DeepSpeed backend tests use the shared ``tiny_models`` and ``ragged_batch`` fixtures of
tests/conftest.py (the Megatron tests load the same ones); this folder and tests/megatron go on the
import path for the rank-side scenario modules."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")
for path in (HERE, MEGATRON_TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)
