"""The backends as siblings: each backend's checkpoint and export (and Megatron's build, step and router losses) are
functions of an explicit state object and never import the worker; both workers implement the one rank interface
(:class:`openrlhf_shape.actor.protocol.RankWorker`) with the same signatures. (That neither backend imports the
other, what both need living in ``openrlhf_shape/actor/``, is their shared floor in ``tests/test_layers.py``.)"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from openrlhf_shape.actor.backends import BACKENDS as RECORDS
from openrlhf_shape.actor.protocol import RankWorker
from openrlhf_shape.config import TrainConfig  # noqa: F401  (registers every backend's record)
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.platform import cpu_platform
from support.imports import edges

PKG = Path(__file__).resolve().parents[2] / "openrlhf_shape"
# each registered backend's package folder -> its worker class (the records' "openrlhf_shape.<folder>.worker:<Class>")
BACKENDS = {r.worker.split(".")[1]: r.worker.rsplit(":", 1)[1] for r in RECORDS.values()}


@pytest.fixture(scope="module")
def imported() -> dict[str, set[str]]:
    """Package module -> what it imports (every import, and module names in strings: tests/support/imports.py)."""
    out: dict[str, set[str]] = {}
    for e in edges():
        out.setdefault(e.source, set()).add(e.target)
    return out


STATE_MODULES = {"megatron": ("build", "step", "router_loss")}  # besides checkpoint, export and state


@pytest.mark.parametrize("backend,name", [(b, n) for b in BACKENDS
                                          for n in ("checkpoint", "export", "state", *STATE_MODULES.get(b, ()))])
def test_checkpoint_and_export_do_not_import_the_worker(backend: str, name: str, imported) -> None:
    assert f"openrlhf_shape.{backend}.worker" not in imported.get(f"openrlhf_shape.{backend}.{name}", set())
    assert BACKENDS[backend] not in (PKG / backend / f"{name}.py").read_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_hands_its_state_to_checkpoint_and_export(backend: str) -> None:
    src = (PKG / backend / "worker.py").read_text()
    calls = {"megatron": ("save_distributed_checkpoint(self.state", "load_distributed_checkpoint(self.state",
                          "iter_buckets(self.state", "export_hf_dir(self.state", "build_model(self.state",
                          "step.logprobs_and_entropy(self.state", "step.train_step(self.state"),
             "zero": ("save_checkpoint(self.state", "load_checkpoint(self.state", "iter_buckets(self.state",
                      "export_hf_dir(self.state")}[backend]
    for call in calls:
        assert call in src, call


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_workers_implement_the_rank_interface(backend: str) -> None:
    import importlib

    cls = getattr(importlib.import_module(f"openrlhf_shape.{backend}.worker"), BACKENDS[backend])
    wanted = {n: f for n, f in vars(RankWorker).items() if callable(f) and not n.startswith("_")}
    assert len(wanted) == 13  # init_reference: the reference model (--algo.kl.init_coef > 0); init_critic, train_values
    for name, proto in wanted.items():
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        want = [p for p in inspect.signature(proto).parameters if p != "self"]
        got = [p for p in inspect.signature(impl).parameters if p != "self"]
        assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} vs the interface's {want}"
    init = list(inspect.signature(cls.__init__).parameters)
    assert init[:2] == ["self", "cfg"] and {"rank", "world_size", "master_addr", "master_port", "platform"} <= set(init)


def test_state_layout_and_guards() -> None:
    st = ActorState(cfg=MegatronConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True),
                    platform=cpu_platform(), rank=0, world_size=4, dp_size=2)
    assert st.layout() == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4, "use_distributed_optimizer": True,
                           "ep": 1, "etp": 2}
    assert st.model_chunks == [] and st.step == 0
    with pytest.raises(RuntimeError, match="init_model"):
        st.require_model()
    with pytest.raises(RuntimeError, match="save_checkpoint needs a model built"):
        st.require_optimizer("save_checkpoint")


def test_zero_state_layout_lr_and_guard() -> None:
    import torch

    from openrlhf_shape.actor.lr_schedule import lr_at
    from openrlhf_shape.zero.config import ZeroConfig
    from openrlhf_shape.zero.state import ZeroState

    from openrlhf_shape.actor.optim import AdamConfig, OptimConfig

    cfg = ZeroConfig(zero_stage=3, optim=OptimConfig(adam=AdamConfig(lr=1e-3), lr_warmup_steps=4))
    st = ZeroState(cfg=cfg, platform=cpu_platform(), rank=1, world_size=2, dp_size=2)
    assert st.layout() == {"dp": 2, "zero_stage": 3, "adam_offload": False}
    with pytest.raises(RuntimeError, match="init_model"):
        st.require_model()

    class _Engine:  # what apply_lr touches: the engine's optimizer param groups
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)

    st.engine, st.step = _Engine(), 2
    assert st.apply_lr() == lr_at(cfg.optim, 2) == _Engine.optimizer.param_groups[0]["lr"]
    assert 0 < st.apply_lr() < 1e-3  # inside the warmup
