"""Builders for tiny, random, offline models used by tests and benchmarks (nothing loads from a hub)."""

from openrlhf_shape.testing.tiny_models import TINY_ARCHS, build_tiny_tokenizer, make_tiny_model

__all__ = ["TINY_ARCHS", "build_tiny_tokenizer", "make_tiny_model"]
