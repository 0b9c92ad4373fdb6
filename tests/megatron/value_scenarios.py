"""Rank side of the value-model tests (tests/megatron, tests/zero): a real worker of either backend builds the
value model of a directory and scores a batch; plain data back to the pytest side."""

from __future__ import annotations

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.rank_configs import megatron_config, replaced, zero_config
from rank_sequence import release_megatron, release_zero


def value_run(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str, cfg: dict,
              value_dir: str, batch: dict, causal_dir: str | None = None, head_seed: int = 0,
              variants: dict | None = None, export_dir: str | None = None, keep_group: bool = False) -> dict:
    """``compute_values`` of ``value_dir``'s model on ``batch`` (``"values"``), of ``causal_dir`` with a head drawn
    from ``head_seed`` (``"drawn"``), and of ``value_dir`` again under each of ``variants``' config switches; then
    the last one's HF export to ``export_dir``."""
    if backend == "megatron":
        from openrlhf_shape.megatron.worker import MegatronRankWorker as Worker

        config, release = megatron_config(cfg), release_megatron
    else:
        from openrlhf_shape.zero.worker import ZeroRankWorker as Worker

        config, release = zero_config(cfg), release_zero
    worker = Worker(config, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                    platform=detect_platform())
    res = {"info": worker.init_value_model(value_dir), "values": worker.compute_values(batch)}
    if causal_dir is not None:
        worker.init_value_model(causal_dir, head_seed=head_seed)
        res["drawn"] = worker.compute_values(batch)
    for name, overrides in (variants or {}).items():
        worker.cfg = replaced(worker.cfg, **overrides)
        worker.init_value_model(value_dir)
        res[name] = worker.compute_values(batch)
    if export_dir is not None:
        worker.export_hf(export_dir)
    release(worker, keep_group)
    return res


def critic_run(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str, cfg: dict,
               value_dir: str, batch, steps: int, value_clip: float, export_dir: str, ckpt_dir: str | None = None,
               save_at: int | None = None, zero: dict | None = None, causal_dir: str | None = None,
               head_seed: int = 0, keep_group: bool = False) -> dict:
    """``steps`` critic updates (``init_critic`` with tests/support/critic_reference.py's optimiser, ``train_values``)
    on ``batch``, the final model exported to ``export_dir``/final; with ``ckpt_dir``: a checkpoint after
    ``save_at`` updates, then a fresh critic loads it and runs the remaining updates, exported to ``.../resumed``;
    with ``causal_dir``: a critic started from that causal LM (its head drawn from ``head_seed``), one update,
    exported to ``.../drawn``."""
    import os

    from support.critic_reference import critic_optim

    worker, release = _worker(backend, cfg, zero, rank=rank, world_size=world_size, master_addr=master_addr,
                              master_port=master_port)
    optim = critic_optim(worker.cfg.optim)
    res = {"info": worker.init_critic(value_dir, optim, value_clip=value_clip), "metrics": []}
    for k in range(steps):
        res["metrics"].append(worker.train_values(batch))
        if ckpt_dir is not None and save_at == k + 1:
            worker.save_checkpoint(ckpt_dir)
    worker.export_hf(os.path.join(export_dir, "final"))
    if ckpt_dir is not None:
        worker.init_critic(value_dir, optim, value_clip=value_clip)
        worker.load_checkpoint(ckpt_dir)
        res["resumed"] = [worker.train_values(batch) for _ in range(steps - save_at)]
        worker.export_hf(os.path.join(export_dir, "resumed"))
    if causal_dir is not None:
        worker.init_critic(causal_dir, optim, value_clip, head_seed)
        res["drawn"] = worker.train_values(batch)
        worker.export_hf(os.path.join(export_dir, "drawn"))
    release(worker, keep_group)
    return res


def _worker(backend: str, cfg: dict, zero: dict | None, **where):
    if backend == "megatron":
        from openrlhf_shape.megatron.worker import MegatronRankWorker as Worker

        config, release = megatron_config(cfg), release_megatron
    else:
        from openrlhf_shape.zero.worker import ZeroRankWorker as Worker

        config, release = zero_config(cfg, **(zero or {})), release_zero
    return Worker(config, platform=detect_platform(), **where), release
