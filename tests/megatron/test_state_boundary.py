"""The megatron circle is broken: checkpoint and export are functions of an explicit
:class:`ActorState` and never import the worker (the resume/export tests in this folder exercise
them through it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.platform import cpu_platform

PKG = Path(__file__).resolve().parents[2] / "openrlhf_shape" / "megatron"


def _imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("name", ["checkpoint.py", "export.py", "state.py"])
def test_checkpoint_and_export_do_not_import_the_worker(name: str) -> None:
    mods = _imported_modules(PKG / name)
    assert "openrlhf_shape.megatron.worker" not in mods
    assert "MegatronRankWorker" not in (PKG / name).read_text()


def test_worker_hands_its_state_to_checkpoint_and_export() -> None:
    src = (PKG / "worker.py").read_text()
    for call in ("save_distributed_checkpoint(self.state", "load_distributed_checkpoint(self.state",
                 "iter_buckets(self.state", "export_hf_dir(self.state"):
        assert call in src, call


def test_state_layout_and_guards() -> None:
    st = ActorState(cfg=MegatronConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True),
                    platform=cpu_platform(), rank=0, world_size=4, dp_size=2)
    assert st.layout() == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4, "use_distributed_optimizer": True}
    assert st.model_chunks == [] and st.step == 0
    with pytest.raises(RuntimeError, match="init_model"):
        st.require_model()
    with pytest.raises(RuntimeError, match="save_checkpoint needs a model built"):
        st.require_optimizer("save_checkpoint")
