"""Megatron actor ranks (TP x PP x DP) as Ray actors, driven SPMD from the trainer.

Each Ray actor owns one :class:`~openrlhf_shape.megatron.worker.MegatronRankWorker`; every call is
sent to all ranks in the same order (Megatron collectives need that) and the results are merged
here. Rank 0's address and a free port form the torch.distributed rendezvous.
"""

from __future__ import annotations

import ray
import torch

from openrlhf_shape.batch import SequenceBatch, TrainBatch, pad_rows
from openrlhf_shape.cluster.sender import WeightSenderMixin
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.worker import MegatronRankWorker, merge_rank_outputs
from openrlhf_shape.platform import Platform


class MegatronRankActor(WeightSenderMixin):
    """Ray actor body: one Megatron rank. Methods run on the actor's main thread (sync actor).

    Built without a rendezvous: the group asks rank 0's actor for its node's address and a free
    port (``endpoint``), then calls ``connect`` on every rank."""

    def __init__(self, cfg: MegatronConfig, rank: int, world_size: int, platform: dict):
        """``platform``: the driver's profile as a dict (``Platform.to_dict()``); rebuilt here, not
        re-detected (``openrlhf_shape/platform.py``)."""
        self.platform = Platform.from_dict(platform)
        if self.platform.threads_per_rank:
            # Ray pins OMP_NUM_THREADS=1 for fractional-CPU actors; on CPU the rank and the engines
            # take turns (rollout, then update), so the rank may use the node's cores while it trains.
            torch.set_num_threads(self.platform.threads_per_rank)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.worker = None

    def connect(self, master_addr: str, master_port: int) -> bool:
        self.worker = MegatronRankWorker(self.cfg, rank=self.rank, world_size=self.world_size,
                                         master_addr=master_addr, master_port=master_port, platform=self.platform)
        return True

    def platform_profile(self) -> dict:
        """The profile this rank runs under (as handed), and the torch threads it set."""
        return {**self.platform.to_dict(), "torch_threads": torch.get_num_threads()}

    def offload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        return self.worker.offload_states(tuple(groups))

    def onload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        return self.worker.onload_states(tuple(groups))

    def stream_weights_out(self, payload, bucket_bytes: int) -> dict:
        """All ranks walk the bridge export in lockstep (it gathers TP shards and PP stages per
        parameter); rank 0 sends each bucket through the weight-sync transport as soon as it is
        produced (nothing is kept), so PP stages reach the engines one after another."""
        buckets = self.worker.iter_hf_weights(bucket_bytes)
        if self.worker.rank != 0:
            for _ in buckets:
                pass
            return {}
        return self.stream_weights(buckets, payload)

    def init_model(self, hf_dir: str) -> dict:
        return self.worker.init_model(hf_dir)

    def compute_logprobs_and_entropy(self, batch: SequenceBatch) -> dict:
        return self.worker.compute_logprobs_and_entropy(batch)

    def train_step(self, batch: TrainBatch) -> dict:
        return self.worker.train_step(batch)

    def save_checkpoint(self, ckpt_dir: str, extra: dict | None = None) -> None:
        self.worker.save_checkpoint(ckpt_dir, extra)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self.worker.load_checkpoint(ckpt_dir)

    def export_hf(self, out_dir: str) -> None:
        self.worker.export_hf(out_dir)

    def shutdown(self) -> None:
        self.worker.shutdown()


class MegatronActorGroup:
    """All Megatron ranks of the actor model (``rank_actor_cls``: the Ray actor body of one rank; the
    DeepSpeed backend's group, :class:`openrlhf_shape.zero.actor.ZeroActorGroup`, swaps it).

    Args:
        cfg: the Megatron layout/optimiser settings.
        world_size: number of ranks (TP x PP x DP).
        placement: an ``openrlhf_shape.cluster.ray_placement.RayPlacement``; rank r on its bundle.
        platform: the run's profile (CPU shares and threads of each rank; handed to every rank).
    """

    rank_actor_cls: type = MegatronRankActor

    def __init__(self, cfg: MegatronConfig, world_size: int, placement, platform: Platform):
        from openrlhf_shape.cluster.ray_placement import spawn_rank_actors

        self.cfg = cfg
        self.world_size = world_size
        self.platform = platform
        if len(placement.plan.ranks) != world_size:
            raise ValueError(f"placement plan has {len(placement.plan.ranks)} ranks, --megatron.world_size {world_size}")
        handed = platform.to_dict()
        self.actors, self.rendezvous = spawn_rank_actors(
            placement, ray.remote(self.rank_actor_cls), num_cpus=platform.cpus_per_rank,
            args_for_rank=lambda r: (cfg, r, world_size, handed))
        ray.get([a.connect.remote(self.rendezvous["ip"], self.rendezvous["port"]) for a in self.actors])

    def _all(self, method: str, *args) -> list:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def init_model(self, hf_dir: str) -> dict:
        return self._all("init_model", hf_dir)[0]

    def compute_logprobs_and_entropy(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` float32 log-probs and entropy of every response token (0-padded), batch order."""
        merged = merge_rank_outputs(self._all("compute_logprobs_and_entropy", batch), len(batch))
        width = batch.response_width
        return pad_rows(merged["log_probs"], width), pad_rows(merged["entropy"], width)

    def train_step(self, batch: TrainBatch) -> dict:
        return self._all("train_step", batch)[0]

    def save_checkpoint(self, ckpt_dir: str, extra: dict | None = None) -> None:
        self._all("save_checkpoint", ckpt_dir, extra)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self._all("load_checkpoint", ckpt_dir)[0]

    def export_hf(self, out_dir: str) -> None:
        self._all("export_hf", out_dir)

    def start_weight_stream(self, payload, bucket_bytes: int) -> list:
        """Refs of every rank's ``stream_weights_out`` (rank 0's result first: the sender's metrics)."""
        return [a.stream_weights_out.remote(payload, bucket_bytes) for a in self.actors]

    def offload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        return self._all("offload_states", tuple(groups))[0]

    def onload_states(self, groups: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict:
        return self._all("onload_states", tuple(groups))[0]

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        except Exception:
            pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def make_actor_group(cfg, mcfg: MegatronConfig, placement, platform: Platform) -> MegatronActorGroup:
    """The actor group of ``--actor.backend`` (``cfg``: the TrainConfig; ``mcfg``: its rank-side
    training settings), its ranks on ``placement``'s bundles under ``platform``."""
    if cfg.actor.backend == "deepspeed":
        from openrlhf_shape.zero.actor import ZeroActorGroup
        from openrlhf_shape.zero.config import zero_config_from

        return ZeroActorGroup(zero_config_from(mcfg, cfg.ds), cfg.megatron.world_size, placement, platform)
    return MegatronActorGroup(mcfg, cfg.megatron.world_size, placement, platform)
