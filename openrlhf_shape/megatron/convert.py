"""Export one of our Megatron checkpoints to a Hugging Face directory, offline (no trainer running).

``export_checkpoint_to_hf(ckpt_dir, out_dir)`` reads the checkpoint's ``meta.json`` (layout and the HF
directory the run started from: config, tokenizer, architecture), starts ``TP x PP`` ranks as
subprocesses (data-parallel size 1), loads the checkpoint and writes safetensors + config + tokenizer
atomically. Used by ``openrlhf-shape convert megatron`` and by ``openrlhf-shape eval`` when it is given
a checkpoint.
"""

from __future__ import annotations

import json
import os

from openrlhf_shape.checkpoint_dir import COMPLETE_MARKER, latest_checkpoint


def _export_rank(rank: int, world_size: int, master_addr: str, master_port: int, *, ckpt_dir: str,
                 out_dir: str, hf_dir: str, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.megatron.worker import MegatronRankWorker
    from openrlhf_shape.platform import detect_platform

    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         use_distributed_optimizer=distributed_optimizer)
    worker = MegatronRankWorker(cfg, rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())  # a driverless rank
    try:
        worker.init_model(hf_dir)
        extra = worker.load_checkpoint(ckpt_dir)
        worker.export_hf(out_dir)
        return {"step": worker.state.step, "extra": extra}
    finally:
        worker.shutdown()


def export_checkpoint_to_hf(ckpt_dir: str, out_dir: str, hf_dir: str | None = None, timeout: float = 3600.0) -> str:
    """Write the policy saved in ``ckpt_dir`` (or the newest checkpoint under it) to ``out_dir``.

    ``hf_dir`` overrides the base model directory recorded in the checkpoint (config/tokenizer source),
    e.g. when the run's files moved. Returns ``out_dir``.
    """
    from openrlhf_shape.actor.launch import run_ranks

    path = os.path.abspath(ckpt_dir)
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        path = latest_checkpoint(path)  # a run's checkpoints/ folder: take the newest complete one
        if path is None:
            raise FileNotFoundError(f"{ckpt_dir} is neither a complete checkpoint (no {COMPLETE_MARKER}) nor a folder holding one")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    base = hf_dir or meta.get("hf_dir")
    if not base or not os.path.isdir(base):
        raise FileNotFoundError(
            f"the checkpoint's base model directory {base!r} does not exist; pass --hf_dir with the model the run "
            "started from (its config and tokenizer are needed)"
        )
    layout = meta["layout"]
    tp, pp = int(layout["tp"]), int(layout["pp"])
    run_ranks(
        "openrlhf_shape.megatron.convert:_export_rank",
        world_size=tp * pp,
        kwargs=dict(ckpt_dir=path, out_dir=os.path.abspath(out_dir), hf_dir=base, tp=tp, pp=pp,
                    distributed_optimizer=bool(layout.get("use_distributed_optimizer", False))),
        timeout=timeout,
    )
    return os.path.abspath(out_dir)
