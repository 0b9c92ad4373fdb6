"""Rank side of test_reward_model_prefix_and_offload_on_cpu.py: a real worker of either backend, configured from the
flags as the trainer configures its reward-model ranks (``TrainConfig`` -> the backend record's rank config), builds
a value model and is driven by a real :class:`~openrlhf_shape.cluster.lifecycle.Lifecycle` as its reward group."""

from __future__ import annotations

from openrlhf_shape.platform import detect_platform


class WatchedGroup:
    """The worker as the lifecycle's reward group (its ``offload_states`` / ``onload_states`` / ``compute_values``
    called through), recording the bytes its parameters' storages hold when its forward runs."""

    def __init__(self, worker, param_bytes):
        self.worker, self.param_bytes, self.bytes_in_forward = worker, param_bytes, []

    def offload_states(self, groups):
        return self.worker.offload_states(groups)

    def onload_states(self, groups):
        return self.worker.onload_states(groups)

    def compute_values(self, batch):
        self.bytes_in_forward.append(self.param_bytes())
        return self.worker.compute_values(batch)


def _rank_config(backend: str, flags: list[str]):
    """(the trainer's config of ``flags``, the rank config a reward-model rank of ``backend`` is handed)."""
    from openrlhf_shape.config import load_config

    cfg = load_config(None, ["--actor.backend", backend, *flags], check_paths=False)
    return cfg, cfg.backend().rank_config(cfg)


def _param_bytes(worker, backend: str):
    """() -> bytes the rank's parameter storages hold now (0: on host, the offloader emptied them)."""
    if backend == "megatron":
        from openrlhf_shape.megatron.offload import state_tensors

        tensors = lambda: state_tensors(worker.state.model_chunks, worker.state.optimizer)  # noqa: E731
    else:
        from openrlhf_shape.zero.offload import state_tensors

        tensors = lambda: state_tensors(worker.state.engine)  # noqa: E731
    return lambda: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in tensors()["params"]}.values())


def prefix_and_offload_run(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                           value_dir: str, prefix: str, batch: dict, export_dir: str) -> dict:
    """``value_dir`` (its head under ``prefix``, config.json naming none) built by a rank configured without
    ``--ds.value_head_prefix`` (the error), then with it (values); then the lifecycle's reward forward, not colocated,
    without and with ``--reward.offload``: its events, the parameter bytes outside and inside the forward, the
    values; last, the model's HF export to ``export_dir`` (``--critic.save_value_network``'s writer)."""
    from openrlhf_shape.cluster.lifecycle import Lifecycle

    if backend == "megatron":
        from openrlhf_shape.megatron.worker import MegatronRankWorker as Worker
    else:
        from openrlhf_shape.zero.worker import ZeroRankWorker as Worker
    worker = Worker(_rank_config(backend, [])[1], rank=rank, world_size=world_size, master_addr=master_addr,
                    master_port=master_port, platform=detect_platform())
    res: dict = {}
    try:
        worker.init_value_model(value_dir)
    except ValueError as exc:
        res["error"] = str(exc)
    cfg, worker.cfg = _rank_config(backend, ["--ds.value_head_prefix", prefix, "--reward.offload"])
    res["info"] = worker.init_value_model(value_dir)
    res["values"] = worker.compute_values(batch)
    param_bytes = _param_bytes(worker, backend)
    for name, offload in (("plain", False), ("offload", cfg.reward.offload)):
        group = WatchedGroup(worker, param_bytes)
        life = Lifecycle(None, None, None, 0, colocate=False, rms=group, rm_offload=offload)
        life.start()
        before = param_bytes()
        values = life.reward_values(batch)
        res[name] = {"events": list(life.events), "before": before, "during": group.bytes_in_forward,
                     "after": param_bytes(), "values": values}
    worker.onload_states(("params",))
    worker.export_hf(export_dir)
    worker.shutdown()
    return res
