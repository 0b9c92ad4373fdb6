"""Routing replay for mixture-of-experts policies (issue 25, part 3): R2 and R3.

The trap: a token's top-k experts are a discrete function of the router logits, so tiny numerical
differences (engine vs trainer kernels, bf16 vs float32, or the weights moving between the old-log-prob
pass and the update) can send a token to other experts, and its log-prob jumps with it. Replay fixes the
experts and lets only the gate probabilities of the fixed experts vary:

* ``r2``: the trainer's old-log-prob pass records the experts it routed every token to; the update passes
  (forward, and the backward through megatron-core's own autograd of the router) replay them.
* ``r3``: the experts the rollout engine chose (vLLM's ``CompletionOutput.routed_experts``) are replayed in
  the old-log-prob pass and in the update passes.

Both go through megatron-core 0.16's router replay (``megatron/core/transformer/moe/router_replay.py``): a
:class:`RouterReplay` per router; in replay the router takes the given indices instead of its top-k and
gathers their scores, so for Qwen3 (softmax over the top-k logits) the gate probabilities are a softmax over
the replayed experts' logits and the router weight gets gradients through exactly those logits.

Routing data travels per sample as an integer tensor ``[L_i, layers, top_k]`` over the sample's tokens
(prompt + response, in order; row j = the experts token j is routed to as an input), the layout vLLM
returns. ``L_i`` may be ``len(sequence) - 1``: the engine never feeds the last sampled token through the
model, and that token's routing cannot change any log-prob of the sequence (causal attention), so a missing
last row is filled with a fixed placeholder. Padding positions of a micro-batch get the same placeholder.

Limits (refused where they would be wrong): pipeline parallelism (recorded indices would have to be gathered
over stages, and with 1F1B plus activation recompute the backward needs megatron-core's REPLAY_BACKWARD
queue: MoE with PP does not run on CPU, where this could be tested), context parallelism, and megatron-core's
fused router (``--megatron.moe_router_fusion``: ``moe_utils.topk_routing_with_score_function`` returns the fused
kernel's top-k before its router-replay branch, so replay would be ignored without an error).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

ROUTING_REPLAY_MODES = ("none", "r2", "r3")

__all__ = ["ROUTING_REPLAY_MODES", "MicroBatchRouting", "RoutingReplay", "moe_routers", "routing_dtype", "check_routed_experts",
           "routing_for_pass"]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact integer dtype for expert ids (vLLM's choice: 8 bits up to 256 experts, else 16)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def moe_routers(gpt: torch.nn.Module) -> list:
    """The model's MoE routers (megatron-core ``TopKRouter``) in layer order; ``[]`` for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    if any(getattr(r, "layer_number", None) is None for r in routers):
        return routers  # module order is layer order in GPTModel's decoder
    return sorted(routers, key=lambda r: int(r.layer_number))


def check_routed_experts(routed: Sequence[torch.Tensor], sequences: Sequence[Sequence[int]], num_layers: int,
                         top_k: int, num_experts: int, *, what: str = "batch.routed_experts") -> None:
    """Validate per-sample routing ``[L_i, layers, top_k]`` against the sequences; errors say the fix."""
    if len(routed) != len(sequences):
        raise ValueError(f"{what} has {len(routed)} entries for {len(sequences)} sequences (one [L_i, layers, top_k] "
                         "tensor per sample)")
    for i, (r, seq) in enumerate(zip(routed, sequences)):
        r = torch.as_tensor(r)
        if r.dim() != 3 or tuple(r.shape[1:]) != (num_layers, top_k):
            raise ValueError(f"{what}[{i}] must be [L_i, layers={num_layers}, top_k={top_k}], got {tuple(r.shape)}: "
                             "the routing was recorded for another model (layers / experts per token differ)")
        if r.shape[0] not in (len(seq), len(seq) - 1):
            raise ValueError(f"{what}[{i}] covers {r.shape[0]} tokens but sequence {i} has {len(seq)}; it must cover "
                             "every token (or all but the last sampled one, as vLLM returns it): request the engine's "
                             "routing for the prompt too (routed_experts_prompt_start=0)")
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= num_experts):
            raise ValueError(f"{what}[{i}] holds expert ids outside [0, {num_experts})")


class RoutingReplay:
    """Record and replay the top-k expert indices of every MoE router of one rank's model.

    Built once per model (:meth:`attach`); each micro-batch is then either recorded (:meth:`recording`,
    :meth:`take_recorded`) or replayed (:meth:`replay`). Under sequence parallelism the router sees this TP
    rank's slice of the sequence: recording gathers it, replay hands each rank its slice.
    """

    def __init__(self, gpt: torch.nn.Module, *, sequence_parallel: bool = False):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = moe_routers(gpt)
        if not routers:
            raise ValueError("routing replay needs a mixture-of-experts model (no MoE router in this one); set "
                             "--megatron.routing_replay none for a dense policy")
        if any(getattr(r.config, "moe_router_fusion", False) for r in routers):
            # the fused top-k path returns before router replay applies: replay would be a silent no-op
            raise ValueError("routing replay with megatron-core's fused router (TransformerConfig.moe_router_fusion) "
                             "would be ignored; set --megatron.moe_router_fusion false or --megatron.routing_replay none")
        for router in routers:
            if getattr(router, "router_replay", None) is None:
                # megatron-core builds one when TransformerConfig.moe_enable_routing_replay is set; the bridge builds
                # the model without it, so attach here. RouterReplay() also registers itself in a class-wide list
                # (every model of the process); we drive our instances directly, so take it back out of that list.
                replay = RouterReplay()
                RouterReplay.global_router_replay_instances.remove(replay)
                router.router_replay = replay
            router.config.moe_enable_routing_replay = True
        cfg = routers[0].config
        if getattr(cfg, "context_parallel_size", 1) > 1:
            raise ValueError("routing replay with context parallelism is not built (tokens are split across CP ranks)")
        self.routers = routers
        self.top_k = int(routers[0].topk)
        self.num_experts = int(cfg.num_moe_experts)
        self.sequence_parallel = bool(sequence_parallel)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def dtype(self) -> torch.dtype:
        return routing_dtype(self.num_experts)

    # ------------------------------------------------------------------ state
    def _set_action(self, action) -> None:
        for r in self.routers:
            r.router_replay.set_router_replay_action(action)

    def clear(self) -> None:
        """Back to free routing; drop recorded and target indices."""
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Free routing, and every router keeps the indices it chose for the last forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.clear()
        self._set_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            self._set_action(None)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Scope of a replayed pass: targets set by :meth:`replay` per micro-batch, cleared at the end."""
        try:
            yield
        finally:
            self.clear()

    # ------------------------------------------------------------------ record
    def take_recorded(self, lengths: Sequence[int], seq_len: int, rows: int) -> list[torch.Tensor]:
        """After a recorded forward of a ``[rows, seq_len]`` micro-batch: per row ``[lengths[k], layers, top_k]``.

        Collective under sequence parallelism (all TP ranks must call it).
        """
        per_layer = []
        for r in self.routers:
            idx = r.router_replay.get_recorded_indices()
            if idx is None:
                raise RuntimeError("routing replay: a router recorded nothing in this forward (was it an MoE forward?)")
            idx = idx.reshape(-1, rows, self.top_k)  # [s_local, b, k]: the router flattens [s, b] s-major
            if self.sequence_parallel:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                idx = gather_from_sequence_parallel_region(idx.contiguous())
            if idx.shape[0] != seq_len:
                raise RuntimeError(f"routing replay: recorded {idx.shape[0]} positions for a micro-batch of {seq_len}")
            per_layer.append(idx)
            r.router_replay.clear_indices()
        full = torch.stack(per_layer, dim=2).to("cpu", self.dtype)  # [s, b, L, k]
        return [full[: int(n), k].clone() for k, n in enumerate(lengths)]

    # ------------------------------------------------------------------ replay
    def replay(self, routed: Sequence[torch.Tensor], seq_len: int, rows: int) -> None:
        """Route the next forward of a ``[rows, seq_len]`` micro-batch (row k < len(routed) = ``routed[k]``'s
        sample; further rows are fillers) by the given indices. Positions a sample does not cover (its last token when the engine left it out, and
        padding) get experts ``0..top_k-1``: causal attention keeps them out of every real token's output."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        L, k = self.num_layers, self.top_k
        target = torch.arange(k, dtype=torch.long).expand(seq_len, rows, L, k).clone()  # [s, b, L, k]
        for b, r in enumerate(routed):
            n = int(r.shape[0])
            target[:n, b] = torch.as_tensor(r).to(torch.long)
        if self.sequence_parallel:
            from megatron.core import parallel_state as mpu

            tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
            if seq_len % tp:
                raise RuntimeError(f"routing replay: sequence length {seq_len} is not a multiple of TP={tp} under SP")
            chunk = seq_len // tp
            target = target[rank * chunk:(rank + 1) * chunk]
        device = self.routers[0].weight.device
        for layer, router in enumerate(self.routers):
            # set_target_indices also queues the tensor for REPLAY_BACKWARD (recompute); cleared by clear()
            router.router_replay.set_target_indices(target[:, :, layer].reshape(-1, k).to(device))
        self._set_action(RouterReplayAction.REPLAY_FORWARD)


class MicroBatchRouting:
    """What the worker's schedule does around each micro-batch forward: record (R2's old-log-prob pass) or
    replay (R2's update, R3's old-log-prob pass and update) the routing of the samples in it.

    ``sequences``: the batch's token ids (lengths of the recorded rows); ``routed``: per batch sample
    ``[L_i, layers, top_k]`` to replay, or None to record.
    """

    def __init__(self, replay: RoutingReplay, sequences: Sequence[Sequence[int]],
                 routed: Sequence[torch.Tensor] | None = None):
        self.replay = replay
        self.sequences = sequences
        self.routed = routed
        self.recorded: dict[int, torch.Tensor] = {}

    @property
    def records(self) -> bool:
        return self.routed is None

    @contextlib.contextmanager
    def active(self) -> Iterator["MicroBatchRouting"]:
        with (self.replay.recording() if self.records else self.replay.replaying()):
            yield self

    def before(self, mb) -> None:
        """Before ``mb``'s forward (``mb``: an ``actor.batching.MicroBatch``, ``input_ids`` ``[rows, s]``; packed:
        one row holding its samples one after another)."""
        if self.records:
            return
        rows, seq_len = mb.input_ids.shape
        routed = [self.routed[r] for r in mb.rows]
        if mb.packed and routed:  # one row: each sample's routing at its offset, every position covered
            routed = [torch.cat([_cover(torch.as_tensor(r), n, self.replay.num_layers, self.replay.top_k)
                                 for r, n in zip(routed, mb.seq_lens)])]
        self.replay.replay(routed, int(seq_len), int(rows))

    def after(self, mb) -> None:
        """After ``mb``'s forward: keep what each of its samples was routed to (recording)."""
        if not self.records:
            return
        rows, seq_len = mb.input_ids.shape
        if mb.packed:
            (full,) = self.replay.take_recorded([int(seq_len)], int(seq_len), 1)
            got = [full[a:a + n].clone() for _, a, n in mb.segments()]
        else:
            got = self.replay.take_recorded([len(self.sequences[r]) for r in mb.rows], int(seq_len), int(rows))
        self.recorded.update(zip(mb.rows, got))


def routing_for_pass(replay: RoutingReplay | None, mode: str, batch, *, update: bool) -> MicroBatchRouting | None:
    """The routing of one forward pass over ``batch`` (a ``SequenceBatch`` or ``TrainBatch``) under ``mode``
    (``--megatron.routing_replay``): None (free routing), record, or replay.

    A batch carrying ``routed_experts`` is replayed (R3's passes, R2's update passes, or any re-run on a known
    routing); without them R2's old-log-prob pass records, and every other replayed pass refuses."""
    if mode == "none" or replay is None:
        return None
    if mode == "r2" and not update and batch.routed_experts is None:
        return MicroBatchRouting(replay, batch.sequences)  # the old-log-prob pass records
    if batch.routed_experts is None:
        source = ("compute_logprobs_and_entropy's 'routed_experts' output (the old-log-prob pass)" if mode == "r2"
                  else "the rollout engine (Generation.routed_experts, EngineConfig.return_routed_experts)")
        raise ValueError(f"--megatron.routing_replay {mode}: this pass needs batch.routed_experts from {source}; "
                         "pass them, or set --megatron.routing_replay none")
    check_routed_experts(batch.routed_experts, batch.sequences, replay.num_layers, replay.top_k, replay.num_experts)
    return MicroBatchRouting(replay, batch.sequences, batch.routed_experts)


def _cover(routed: torch.Tensor, n: int, layers: int, top_k: int) -> torch.Tensor:
    """A sample's ``[L_i, layers, top_k]`` routing over all its ``n`` tokens: a missing last token (the engine
    never feeds it) gets experts ``0..top_k-1``, as padding does; its output feeds no log-prob."""
    missing = n - int(routed.shape[0])
    if missing <= 0:
        return routed.to(torch.long)
    fill = torch.arange(top_k, dtype=torch.long).expand(missing, layers, top_k)
    return torch.cat([routed.to(torch.long), fill])
