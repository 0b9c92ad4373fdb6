"""Fixtures for trainer tests: a tiny Qwen3 and a parity reward plug-in (an OpenRLHF-style .py)."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# A real reward plug-in file (loaded by our plug-in loader): reward 1 when the response has an even
# number of characters. A random tiny model never solves maths, and this gives groups with reward
# variance so every advantage path is exercised.
PARITY_REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kw):
    rewards = [float(len(q) - len(p)) % 2 == 0 for q, p in zip(queries, prompts)]
    r = torch.tensor([float(x) for x in rewards])
    return {"rewards": r, "scores": r, "extra_logs": {"parity/mean": r.mean()}}
'''


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_trainer"), arch="qwen3", seed=0))


@pytest.fixture(scope="session")
def parity_reward_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    p.write_text(PARITY_REWARD)
    return str(p)
