"""The backend record (``actor/backends.py``): the one place a backend's name meets what the trainer needs of it.
Nothing above the backends' own packages compares ``--actor.backend`` with a name except the dry-run planner's
memory model; a record registered under a new name is what the config checks, the dtype check and the log-prob gap
guard read, with no other file touched."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from openrlhf_shape.actor.backends import BACKENDS, Backend, register
from openrlhf_shape.config import load_config
from openrlhf_shape.config.checks import check_dtypes
from openrlhf_shape.platform import cpu_platform, gpu_platform

PKG = Path(__file__).resolve().parents[2] / "openrlhf_shape"
# where a backend truly differs by name: each backend's own package, and the dry-run planner's memory model of each
BRANCHES_ALLOWED = ("megatron/", "zero/", "planner/")


def _branches_on_backend_names(path: Path) -> list[str]:
    """``line: source`` of each comparison with a registered backend's name in ``path``."""
    names = set(BACKENDS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
            if consts & names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_above_the_backends_branches_on_their_names():
    assert set(BACKENDS) == {"megatron", "deepspeed"}
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith(BRANCHES_ALLOWED) and (hits := _branches_on_backend_names(path)):
            found[rel] = hits
    assert not found, f"read the backend record (cfg.backend()) instead: {found}"


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"^--actor.backend: 'fsdp2'; use one of megatron, deepspeed"):
        load_config(None, ["--actor.backend", "fsdp2"])


def test_a_new_record_is_what_the_trainer_reads():
    """A record registered under a new name (here DeepSpeed's, renamed, its dtype flag another) is taken by the config
    checks, the dtype check and the gap guard as it is: the record is all a new backend adds above its package."""
    from openrlhf_shape.trainer.logprob_guard import guard_for_run

    new = register(dataclasses.replace(BACKENDS["deepspeed"], name="fsdp2_probe", dtype_flag="ds.param_dtype"))
    try:
        cfg = load_config(None, ["--actor.backend", "fsdp2_probe", "--ds.param_dtype", "bf16"])
        assert cfg.backend() is new and isinstance(new, Backend)
        assert check_dtypes(cfg, cpu_platform()).startswith("--ds.param_dtype bf16 on a CPU run")
        assert check_dtypes(cfg, gpu_platform()) is None
        assert guard_for_run(cfg, cpu_platform(), object(), "float32").dtype == "bfloat16"
        with pytest.raises(ValueError, match="--actor.backend deepspeed shards over data parallelism only"):
            load_config(None, ["--actor.backend", "fsdp2_probe", "--megatron.tensor_model_parallel_size", "2",
                               "--actor.num_gpus_per_node", "2"])
    finally:
        BACKENDS.pop("fsdp2_probe")


@pytest.mark.parametrize("name", ["megatron", "deepspeed"])
def test_each_record_builds_its_rank_config_from_the_flags(name):
    cfg = load_config(None, ["--actor.backend", name, "--train.max_tokens_per_gpu", "1000"])
    rank = cfg.backend().rank_config(cfg)
    assert rank.optim == cfg.optim_config() and rank.ranks_per_replica == 1
    assert cfg.backend().worker.startswith(f"openrlhf_shape.{'zero' if name == 'deepspeed' else name}.worker:")
