"""The critic's calls as the Ray rank group makes them (``cluster/rank_group.py``: positional arguments through
``RankActor.call``) bind to both backends' workers, and the rank-worker interface lists them."""

from __future__ import annotations

import inspect

import pytest


@pytest.mark.parametrize("worker", ["openrlhf_shape.megatron.worker:MegatronRankWorker",
                                    "openrlhf_shape.zero.worker:ZeroRankWorker"])
def test_rank_group_critic_calls_bind_to_the_workers(worker: str) -> None:
    import importlib

    from openrlhf_shape.actor.optim import OptimConfig
    from openrlhf_shape.actor.protocol import RankWorker
    from openrlhf_shape.cluster.rank_group import RankGroup

    module, name = worker.split(":")
    cls = getattr(importlib.import_module(module), name)
    for method in ("init_critic", "train_values"):
        assert hasattr(RankWorker, method)
        group_args = list(inspect.signature(getattr(RankGroup, method)).parameters)[1:]  # what the group hands on
        signature = inspect.signature(getattr(cls, method))
        signature.bind(object(), *group_args)  # raises when the group's positional call would not bind
        assert list(signature.parameters)[1:1 + len(group_args)] == group_args  # each argument lands where named
    params = inspect.signature(cls.init_critic).parameters
    assert params["optim"].annotation in (OptimConfig, "OptimConfig")
    assert params["value_clip"].default == 0.5 and params["head_seed"].default is None
