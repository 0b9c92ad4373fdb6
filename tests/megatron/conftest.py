"""The Megatron backend tests use the shared ``tiny_models`` and ``ragged_batch`` fixtures of
tests/conftest.py (the DeepSpeed tests load the same ones)."""
