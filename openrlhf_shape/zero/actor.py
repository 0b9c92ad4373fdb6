"""DeepSpeed ranks as Ray actors: the Megatron rank actor's body and group, with the rank worker swapped.

Everything else is shared with the Megatron backend (:mod:`openrlhf_shape.trainer.actor_group`): the
placement on the plan's bundles and the rendezvous on rank 0's node, SPMD dispatch, the merge of
per-rank log-probs, the weight stream (rank 0 sends while all ranks walk the buckets in lockstep:
under ZeRO-3 each bucket is a gather), offload/onload for colocation.
"""

from __future__ import annotations

from openrlhf_shape.trainer.actor_group import MegatronActorGroup, MegatronRankActor


class ZeroRankActor(MegatronRankActor):
    """Ray actor body: one DeepSpeed rank (a :class:`~openrlhf_shape.zero.worker.ZeroRankWorker`)."""

    def connect(self, master_addr: str, master_port: int) -> bool:
        from openrlhf_shape.zero.worker import ZeroRankWorker

        self.worker = ZeroRankWorker(self.cfg, rank=self.rank, world_size=self.world_size,
                                     master_addr=master_addr, master_port=master_port, platform=self.platform)
        return True


class ZeroActorGroup(MegatronActorGroup):
    """All DeepSpeed ranks of the actor (``cfg``: a :class:`~openrlhf_shape.zero.config.ZeroConfig`)."""

    rank_actor_cls = ZeroRankActor
