"""The training backends as the trainer sees them: one :class:`Backend` record per ``--actor.backend`` name.

Each backend's package writes its own record (``megatron/backend.py``, ``zero/backend.py``) and registers it here;
``config/tree.py``, which holds each backend's flag section, imports them, so every ``TrainConfig`` sees them all
(``TrainConfig.backend()``). The config checks, the set-up, the cluster and the log-prob gap guard read the record;
only the dry-run planner's memory model tells the backends apart by name (their memory differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from openrlhf_shape.platform import Platform


@dataclass(frozen=True)
class Backend:
    """What the trainer needs of one backend. ``cfg`` below is the ``TrainConfig``."""

    name: str  # its --actor.backend value
    worker: str  # "module:Class" of its RankWorker (actor/protocol.py), imported in the rank processes only
    # cfg -> what every rank is handed (a config with ``optim``, ``for_platform``, ``ranks_per_replica``); refuses,
    # naming them, the flags this backend cannot honour
    rank_config: Callable[[Any], Any]
    check_model: Callable[[Any, Any, str], None]  # (cfg, HF config, model dir): refuse a model it cannot train
    # (cfg, the run's platform) -> "float32" | "bfloat16", the ranks' parameters; refuses a dtype it cannot run there
    trainer_dtype: Callable[[Any, Platform], str]
    dtype_flag: str  # the flag that sets that dtype (named when a CPU would only emulate bf16)


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"--actor.backend: {name!r}; use one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
