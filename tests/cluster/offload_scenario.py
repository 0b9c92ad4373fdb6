"""Rank-side scenario for the offload test (run in subprocesses by ``launch.run_ranks``)."""

from __future__ import annotations

import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.batch import TrainBatch
from openrlhf_shape.testing.rank_configs import megatron_config
from openrlhf_shape.actor.offload import GROUPS
from openrlhf_shape.megatron.offload import state_tensors
from openrlhf_shape.megatron.worker import MegatronRankWorker


def _snapshot(worker) -> dict[str, list[torch.Tensor]]:
    return {g: [t.detach().clone() for t in ts] for g, ts in state_tensors(worker.state.model_chunks, worker.state.optimizer).items()}


def run_both(**kw) -> dict:
    """The plain run, then the run with the round trips on a fresh worker, in the same rank processes (one
    launch). The plain run goes first so the reference runs in pristine processes; between the two only the
    model-parallel state is destroyed (the default process group stays)."""
    return {"plain": run(**kw, offload=False, keep_group=True), "offload": run(**kw, offload=True)}


def run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model_dir: str,
        batches: list[dict], offload: bool, keep_group: bool = False) -> dict:
    w = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, platform=detect_platform())
    w.init_model(model_dir)
    batches = [TrainBatch.from_ragged(b["sequences"], b["prompt_lens"], b["old_log_probs"], b["advantages"],
                                      temperature=b["temperature"]) for b in batches]
    out: dict = {"metrics": [w.train_step(batches[0])]}
    if offload:
        before = _snapshot(w)
        assert all(before[g] for g in GROUPS), {g: len(v) for g, v in before.items()}
        info = w.offload_states()
        out["offloaded_bytes"] = info["offloaded_bytes"]
        out["empty_after_offload"] = all(t.untyped_storage().nbytes() == 0
                                         for ts in state_tensors(w.state.model_chunks, w.state.optimizer).values() for t in ts)
        errors = []
        for call in (lambda: w.train_step(batches[1]), lambda: w.compute_logprobs_and_entropy(batches[1]),
                     lambda: list(w.iter_hf_weights(1 << 20))):
            try:
                call()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        out["errors_while_offloaded"] = errors
        w.onload_states(("params",))
        out["forward_with_params_only"] = bool(w.compute_logprobs_and_entropy(batches[1]) is not None)
        try:
            w.train_step(batches[1])
            out["train_with_params_only"] = "ran"
        except RuntimeError as e:
            out["train_with_params_only"] = str(e)
        w.onload_states()
        after = _snapshot(w)
        out["restored_bitwise"] = all(
            len(before[g]) == len(after[g]) and all(torch.equal(a, b) for a, b in zip(before[g], after[g]))
            for g in GROUPS)
        # a second round trip reuses the host buffers of the first (pinned on GPU): nothing new allocated
        allocated = w.offloader.host_bytes_allocated
        w.offload_states()
        w.onload_states()
        out["host_bytes_first_and_second_round"] = (allocated, w.offloader.host_bytes_allocated)
        out["restored_bitwise_again"] = all(
            all(torch.equal(a, b) for a, b in zip(before[g], _snapshot(w)[g])) for g in GROUPS)
    out["metrics"].append(w.train_step(batches[1]))
    if keep_group:  # another worker follows in this process: free this one, keep the process group
        from megatron.core import parallel_state as mpu

        w.state.model = w.state.optimizer = None
        mpu.destroy_model_parallel()
    else:
        w.shutdown()
    return out
