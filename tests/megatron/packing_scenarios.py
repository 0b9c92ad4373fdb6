"""Rank-side scenarios of the packing tests (tests/megatron/test_packing_on_cpu.py, tests/zero/test_zero_packing_on_cpu.py).

Each layout pass builds the model from the HF weights, computes the log-probs and entropy of the batch, then takes
one optimizer step on it and returns the gradients of that step (before clipping: ``max_norm`` 0 in the tests), so
the pytest side compares packed micro-batches against padded ones on the same weights and tokens. The logits watch
(:class:`~openrlhf_shape.testing.logits_watch.LogitsWatch`) records the largest ``[rows, vocab shard]`` tensor of a
forward-only pass and of a training step, at a small head chunk and at one larger than any micro-batch (the
negative control: there the head holds a micro-batch's whole ``[N, V/tp]``).
"""

from __future__ import annotations

from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.megatron.step import plan
from openrlhf_shape.megatron.worker import MegatronRankWorker
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.batches import train_batches
from openrlhf_shape.testing.logits_watch import LogitsWatch
from openrlhf_shape.testing.rank_configs import megatron_config, replaced
from rank_sequence import release_megatron, release_zero

LAYOUTS = (("packed", True), ("padded", False))
UNCHUNKED = 1 << 20  # a head chunk larger than any micro-batch


def megatron_packing_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict,
                         model_dirs: dict, batch: dict, watch_arch: str | None = None,
                         variants: dict | None = None, keep_group: bool = False) -> dict:
    """For every arch: packed and padded passes (:func:`layout_pass`); the logits watch on ``watch_arch``; then
    for each of ``variants`` (name -> (config overrides, archs)) the same passes on the same ranks."""
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())
    res: dict = {arch: {name: layout_pass(worker, path, batch, pack) for name, pack in LAYOUTS}
                 for arch, path in model_dirs.items()}
    if watch_arch is not None:
        res["watch"] = watch_head(worker, model_dirs[watch_arch], batch)
    for vname, (overrides, archs) in (variants or {}).items():
        worker.cfg = replaced(worker.cfg, **overrides)
        res.setdefault("variants", {})[vname] = {
            arch: {name: layout_pass(worker, model_dirs[arch], batch, pack) for name, pack in LAYOUTS} for arch in archs}
    release_megatron(worker, keep_group)
    return res


def layout_pass(worker, path: str, batch: dict, pack: bool) -> dict:
    """Log-probs + entropy, then one step's gradients (per parameter, this rank's shard) and metrics, and the
    micro-batches the step ran (count, positions computed)."""
    worker.cfg = replaced(worker.cfg, pack_samples=pack)
    worker.init_model(path)
    out = {"logprobs": worker.compute_logprobs_and_entropy(batch)}
    step = train_batches(batch, 1, seed=1234)[0]
    if isinstance(worker, MegatronRankWorker):  # the reduced gradients stay in the grad buffers after the step
        out["metrics"] = worker.train_step(step)
        out["grads"] = {n: p.main_grad.detach().float().cpu().clone() for n, p in worker.state.gpt.named_parameters()}
        _, mbs = plan(worker.state, SequenceBatch.coerce(batch), forward_only=False)
    else:  # DeepSpeed: read them at the accumulation boundary, before the step releases them
        from deepspeed.utils import safe_get_full_grad

        worker._accumulate_gradients(step)
        out["grads"] = {n: safe_get_full_grad(p).detach().float().cpu().clone()
                        for n, p in worker.policy.hf.named_parameters()}
        _, mbs = worker._plans(SequenceBatch.coerce(batch), forward_only=False)
    out["micro_batches"] = [{"rows": list(mb.rows), "shape": tuple(mb.input_ids.shape), "packed": mb.packed}
                            for mb in mbs]
    return out


def watch_head(worker, path: str, batch: dict) -> dict:
    """Largest logits-shaped tensor (rows) of a forward-only pass and of a training step, packed, at the
    configured head chunk and unchunked; and the most response tokens in one micro-batch."""
    chunk = worker.cfg.optim.entropy_chunk_size
    out: dict = {"chunk": chunk}
    for name, size in (("chunked", chunk), ("unchunked", UNCHUNKED)):
        worker.cfg = replaced(worker.cfg, pack_samples=True, entropy_chunk_size=size)
        worker.init_model(path)
        vocab = _vocab_shard(worker)
        with LogitsWatch(vocab) as fwd:
            worker.compute_logprobs_and_entropy(batch)
        with LogitsWatch(vocab) as train:
            worker.train_step(train_batches(batch, 1, seed=1234)[0])
        out[name] = {"forward": fwd.max_rows, "train": train.max_rows, "vocab": vocab}
    if isinstance(worker, MegatronRankWorker):
        _, mbs = plan(worker.state, SequenceBatch.coerce(batch), forward_only=False)
    else:
        _, mbs = worker._plans(SequenceBatch.coerce(batch), forward_only=False)
    out["max_response_tokens"] = max(int(mb.resp_targets.numel()) for mb in mbs)
    worker.cfg = replaced(worker.cfg, entropy_chunk_size=chunk)
    return out


def _vocab_shard(worker) -> int:
    if isinstance(worker, MegatronRankWorker):
        gpt = worker.state.gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        return int(weight.shape[0])
    return int(worker.state.hf_config.vocab_size)


def zero_packing_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, zero: dict,
                     model_dirs: dict, batch: dict, watch_arch: str | None = None, keep_group: bool = False) -> dict:
    """The DeepSpeed backend's packed and padded passes (and the logits watch) as :func:`megatron_packing_run`."""
    from openrlhf_shape.testing.rank_configs import zero_config
    from openrlhf_shape.zero.worker import ZeroRankWorker

    worker = ZeroRankWorker(zero_config(cfg, **zero), rank=rank, world_size=world_size, master_addr=master_addr,
                            master_port=master_port, platform=detect_platform())
    res: dict = {arch: {name: layout_pass(worker, path, batch, pack) for name, pack in LAYOUTS}
                 for arch, path in model_dirs.items()}
    if watch_arch is not None:
        res["watch"] = watch_head(worker, model_dirs[watch_arch], batch)
    release_zero(worker, keep_group)
    return res
