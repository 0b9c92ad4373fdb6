"""The training ranks of any backend as Ray actors, driven SPMD from the trainer.

:class:`RankGroup` starts one :class:`RankActor` per rank on the placement's bundles; each actor hosts
one rank worker of the class it is named (a :class:`openrlhf_shape.actor.protocol.RankWorker`: a backend
record's ``worker``, imported in the rank process). Every call goes to all ranks in the same order (the workers'
collectives need that) and the results are merged here. Rank 0's address and a free port form the
torch.distributed rendezvous. Nothing here knows which backend runs.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import ray
import torch

from openrlhf_shape.actor.protocol import STATE_GROUPS, RankWorker
from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.actor.rank_outputs import merge_rank_outputs, merge_value_outputs
from openrlhf_shape.batch import LogProbs, SequenceBatch, TrainBatch, ValueBatch
from openrlhf_shape.busy_clock import BusyClock
from openrlhf_shape.cluster.placement import role_slots
from openrlhf_shape.cluster.ray_placement import local_endpoint
from openrlhf_shape.platform import Platform
from openrlhf_shape.startup_gc import collector_paused
from openrlhf_shape.weight_sync.sender import WeightSenderMixin


class RankActor(WeightSenderMixin):
    """Ray actor body: one rank, hosting an instance of the ``worker`` class it is named. Methods run on the
    actor's main thread.

    Built without a rendezvous: the group asks rank 0's actor for its node's address and a free port
    (``endpoint``), then calls ``connect`` on every rank, which builds the worker."""

    def __init__(self, worker: str, cfg: Any, rank: int, world_size: int, platform: dict):
        """``worker``: the rank worker class's ``"module:QualName"``, imported here with the collector
        paused (Megatron's import spent ~0.85 of a rank's ~4 start-up CPU-seconds in
        collections; ``openrlhf_shape/startup_gc.py``). ``platform``: the driver's profile as a dict
        (``Platform.to_dict()``); rebuilt here, not re-detected (``openrlhf_shape/platform.py``)."""
        module, _, qualname = worker.partition(":")
        with collector_paused():
            worker_cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            worker_cls = getattr(worker_cls, part)
        self.platform = Platform.from_dict(platform)
        if self.platform.threads_per_rank:
            # Ray pins OMP_NUM_THREADS=1 for fractional-CPU actors; on CPU the rank and the engines
            # take turns (rollout, then update), so the rank may use the node's cores while it trains.
            torch.set_num_threads(self.platform.threads_per_rank)
        self.worker_cls, self.cfg, self.rank, self.world_size = worker_cls, cfg, rank, world_size
        self.worker: RankWorker | None = None

    def endpoint(self) -> dict[str, Any]:
        """This actor's node id, node IP and a free port there: rank 0's serves the torch.distributed
        rendezvous and the collective weight sync's (``weight_sync/collective.py``)."""
        return local_endpoint()

    def connect(self, master_addr: str, master_port: int) -> bool:
        with collector_paused():  # the worker's build (DeepSpeed imports there)
            self.worker = self.worker_cls(self.cfg, rank=self.rank, world_size=self.world_size,
                                          master_addr=master_addr, master_port=master_port, platform=self.platform)
        return True

    def pid(self) -> int:
        """This rank's process id (a test SIGKILLs it to show the trainer's recovery, ``--train.max_restarts``)."""
        return os.getpid()

    def platform_profile(self) -> dict:
        """The profile this rank runs under (as handed), and the torch threads it set."""
        return {**self.platform.to_dict(), "torch_threads": torch.get_num_threads()}

    def call(self, method: str, *args, **kwargs) -> Any:
        """Run one :class:`RankWorker` method on this rank's worker."""
        return getattr(self.worker, method)(*args, **kwargs)

    def stream_weights_out(self, sync_id: str, bucket_bytes: int) -> dict:
        """All ranks walk the worker's HF export in lockstep (it gathers TP shards / PP stages / ZeRO
        partitions per bucket); rank 0 sends each bucket through the sync's transport as soon as it
        is produced (nothing is kept)."""
        buckets = self.worker.iter_hf_weights(bucket_bytes)
        if self.rank != 0:
            for _ in buckets:
                pass
            return {}
        return self.stream_weights(buckets, sync_id, bucket_bytes=bucket_bytes)


GRACE_S = 5.0  # after a rank's call failed: how long the others may take to show that a rank died (the cause)


class RankDiedError(RuntimeError):
    """A rank's actor died (a Ray ``RayActorError``: its process was killed, OOM, its node lost) during a call into
    the group: names the rank (``who``, e.g. ``actor rank 1``) and the call. The trainer restarts the rank groups and
    resumes from the newest complete checkpoint (``--train.max_restarts``), or stops naming it."""

    def __init__(self, who: str, method: str, cause: BaseException):
        super().__init__(f"{who} died during {method} ({type(cause).__name__})")
        self.who, self.method = who, method


class RankGroup:
    """All ranks of the actor model (or of the reference or reward model), each a :class:`RankActor` hosting a
    ``worker``.

    Args:
        worker: the backend's rank worker class (a :class:`~openrlhf_shape.actor.protocol.RankWorker`) as
            ``"module:QualName"`` (``Backend.worker``; the driver never imports it).
        cfg: the worker's config (handed to every rank as is).
        world_size: number of ranks.
        placement: an ``openrlhf_shape.cluster.ray_placement.RayPlacement``; rank r on its bundle.
        platform: the run's profile (CPU shares and threads of each rank; handed to every rank).
        role: ``actor``; ``reference``: the reference model's ranks (the plan's ``refs``: a torch.distributed world of
            their own), built by :meth:`init_reference`; ``reward``: the reward model's (the plan's ``rms``), built by
            :meth:`init_value_model`; ``critic``: the critic's (the plan's ``critics``), built by :meth:`init_critic`.
    """

    def __init__(self, worker: str, cfg: Any, world_size: int, placement, platform: Platform, role: str = "actor"):
        planned = len(role_slots(placement.plan, role))
        if planned != world_size:
            flag = {"actor": "--actor", "reference": "--ref", "reward": "--reward", "critic": "--critic"}[role]
            raise ValueError(f"placement plan has {planned} ranks, {flag}.num_nodes x {flag}.num_gpus_per_node = "
                             f"{world_size}")
        self.worker, self.cfg, self.world_size, self.platform = worker, cfg, world_size, platform
        self.role, self.placement = role, placement
        self.actors: list = []
        self.value_dir: str | None = None
        self.head_seed: int | None = None
        self.critic_args: tuple | None = None  # init_critic's arguments: what restart_ranks builds again
        self._spawn()
        self.clock = BusyClock()  # ranks at work (a call in flight); the weight stream is timed by the sync

    @property
    def name(self) -> str:
        return self.role

    def _spawn(self) -> None:
        """One fresh actor per rank on its bundle, connected (rank 0's node serves the rendezvous)."""
        from openrlhf_shape.cluster.ray_placement import spawn_rank_actors

        handed = self.platform.to_dict()
        self.actors, self.rendezvous = spawn_rank_actors(
            self.placement, ray.remote(RankActor), num_cpus=self.platform.cpus_per_rank, role=self.role,
            args_for_rank=lambda r: (self.worker, self.cfg, r, self.world_size, handed))
        self._gather([a.connect.remote(self.rendezvous["ip"], self.rendezvous["port"]) for a in self.actors], "connect")

    def restart(self) -> None:
        """Kill every rank's actor (a dead one's peers may hang in a collective) and start new ones on the same
        bundles, connected but without a model: the caller builds it again (``init_model`` / ``init_reference``)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self._spawn()

    def _all(self, method: str, *args, **kwargs) -> list:
        with self.clock.working():
            return self._gather([a.call.remote(method, *args, **kwargs) for a in self.actors], method)

    def _gather(self, refs: list, method: str) -> list:
        """``ray.get`` of one call's refs (rank order), failing as soon as one fails: a rank whose actor died raises
        :class:`RankDiedError` (preferred for :data:`GRACE_S` after another rank's failure, which a peer's death
        causes: its collective breaks), so the trainer sees the death instead of waiting on the survivors."""
        rank_of = {r.hex(): i for i, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                raise RankDiedError(f"{self.name} rank {rank_of[done[0].hex()]}", method, err) from err
            except Exception:
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S) if pending else ([], [])
                for r in more:
                    try:
                        ray.get(r)
                    except ray.exceptions.RayActorError as err:
                        raise RankDiedError(f"{self.name} rank {rank_of[r.hex()]}", method, err) from err
                    except Exception:
                        pass
                raise
        return ray.get(refs)

    def init_model(self, hf_dir: str) -> dict:
        return self._all("init_model", hf_dir)[0]

    def init_reference(self, hf_dir: str) -> dict:
        """The reference model from ``hf_dir`` on every rank (forward only)."""
        return self._all("init_reference", hf_dir)[0]

    def init_value_model(self, hf_dir: str, head_seed: int | None = None) -> dict:
        """A value model (OpenRLHF's reward-model format: its head and config.json's mean/std) from ``hf_dir`` on
        every rank, forward only (a directory without a head: one drawn from ``head_seed``); the description names
        its head and the mean/std."""
        self.value_dir, self.head_seed = hf_dir, head_seed  # what restart_ranks builds again
        return self._all("init_value_model", hf_dir, head_seed=head_seed)[0]

    def compute_values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per sample of response R its raw state values ``[R + 1]`` float32 in batch order (the last: the score)."""
        return merge_value_outputs(self._all("compute_values", batch), len(batch))

    def compute_logprobs_and_entropy(self, batch: SequenceBatch) -> LogProbs:
        """Float32 log-probs and entropy of every response token, per sample in batch order (with MoE routing
        replay, ``--megatron.routing_replay``, the routing per sample ``[L_i, layers, top_k]``)."""
        return merge_rank_outputs(self._all("compute_logprobs_and_entropy", batch), len(batch))

    def train_step(self, batch: TrainBatch) -> dict:
        return self._all("train_step", batch)[0]

    def init_critic(self, hf_dir: str, optim: OptimConfig, value_clip: float | None, head_seed: int | None) -> dict:
        """The critic on every rank (:meth:`RankWorker.init_critic`): ``hf_dir``'s value model with its own optimiser."""
        self.critic_args = (hf_dir, optim, value_clip, head_seed)
        return self._all("init_critic", hf_dir, optim, value_clip, head_seed)[0]

    def train_values(self, batch: ValueBatch) -> dict:
        """One critic update (:meth:`RankWorker.train_values`); rank 0's metrics (every rank's are the same)."""
        return self._all("train_values", batch)[0]

    def save_checkpoint(self, ckpt_dir: str, extra: dict | None = None) -> None:
        self._all("save_checkpoint", ckpt_dir, extra)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self._all("load_checkpoint", ckpt_dir)[0]

    def export_hf(self, out_dir: str) -> None:
        self._all("export_hf", out_dir)

    def start_weight_stream(self, sync_id: str, bucket_bytes: int) -> list:
        """Refs of every rank's ``stream_weights_out`` (rank 0's result first: the sender's metrics)."""
        return [a.stream_weights_out.remote(sync_id, bucket_bytes) for a in self.actors]

    def offload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        return self._all("offload_states", tuple(groups))[0]

    def onload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        return self._all("onload_states", tuple(groups))[0]

    def shutdown(self) -> None:
        try:
            ray.get([a.call.remote("shutdown") for a in self.actors], timeout=60)
        except Exception:
            pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []
