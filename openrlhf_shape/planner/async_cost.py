"""Step time of the one-step-off schedule (``--train.async_enable``, disaggregated layouts only), composed
from the synchronous phases of :func:`~openrlhf_shape.planner.cost.step_time`: no phase changes its
seconds, only what runs at the same time.

The trainer's window ``t`` (E = the vLLM engines, R = the Megatron ranks; a window ends with the weight
sync, which needs both sides idle):

* synchronous: gen + rewards (E) -> log-probs + entropy (R) -> probes (E) -> update (R) -> sync; the
  step is the sum of the phases;
* ``max_staleness 1``: log-probs + entropy of batch t (R), then its probes (E), serially (SHAPE's
  segmentation needs the trainer's entropy of batch t, which exists only after the previous update);
  then update(t) on R while E generates and rewards batch t+1; then the sync.
  Step = log-probs + probes + max(update, decode + rewards) + sync;
* ``max_staleness 2``: log-probs + entropy of batch t+1 (R), then update(t) on R while E probes batch
  t+1 and generates and rewards batch t+2; then the sync.
  Step = log-probs + max(update, probes + decode + rewards) + sync.

The MoE all-to-all is rank time: its log-probs part goes with the log-probs, its update part with the
update (``Phase.parts``). GRPO has no probes (:func:`without_probes`). Asynchronous probes also prefill each
response once more (``Phase.cold_cache_seconds``): the weights that arrive between the rollout and the probes
reset the engines' prefix cache (measured on the CPU demo: probes 10.8 s -> 14.3 s, prefix hit rate 0.81 -> 0.71).

Partial rollouts (``--plan.partial_rollout_cap_tokens``): the decode of a window is ``Phase.partial_seconds``, its
tail cut at the cap (a longer response finishes in later windows, under newer weights); the synchronous step
cannot do this and keeps the whole tail.
"""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_shape.planner.cost import Phase

LOGPROBS, UPDATE, PROBES, DECODE, REWARDS, SYNC = (
    "log-probs + entropy", "update", "SHAPE probes", "rollout decode", "rewards", "weight sync")
COLD = "probe re-prefill"  # part of the probes' seconds (Phase.cold_cache_seconds)
STALENESS = (1, 2)


@dataclass(frozen=True)
class AsyncStep:
    staleness: int
    seconds: float
    engine_busy: float  # seconds per step the engines work (probes, decode, rewards, the sync)
    rank_busy: float  # seconds per step the ranks work (log-probs, update, the sync)
    how: str  # the critical path, and who waits for whom

    @property
    def engine_idle(self) -> float:
        """Share of the step the engine GPUs wait."""
        return max(0.0, 1.0 - self.engine_busy / self.seconds) if self.seconds > 0 else 0.0

    @property
    def rank_idle(self) -> float:
        """Share of the step the rank GPUs wait."""
        return max(0.0, 1.0 - self.rank_busy / self.seconds) if self.seconds > 0 else 0.0


def without_probes(phases: list[Phase]) -> list[Phase]:
    """The same step as GRPO runs it: every phase but the SHAPE probes."""
    return [p for p in phases if p.name != PROBES]


def _seconds_by_place(phases: list[Phase]) -> dict[str, float]:
    t = dict.fromkeys((LOGPROBS, UPDATE, PROBES, DECODE, REWARDS, SYNC, COLD), 0.0)
    for p in phases:
        t[PROBES] += p.cold_cache_seconds  # async probes re-prefill their responses (module doc)
        t[COLD] += p.cold_cache_seconds
        if p.parts:
            for name, s in p.parts:
                t[name] += s
        elif p.name == DECODE and p.partial_seconds is not None:  # partial rollouts: the tail spreads over windows
            t[DECODE] += p.partial_seconds
        elif p.name in t and p.name != COLD:
            t[p.name] += p.seconds
        else:  # a phase the schedule does not place: refuse rather than drop its seconds
            raise ValueError(f"async_step: no place in the one-step-off schedule for phase {p.name!r}")
    return t


def async_step(phases: list[Phase], staleness: int) -> AsyncStep:
    """Seconds of one window of the one-step-off schedule at ``staleness`` (1 or 2) for ``phases`` (the
    synchronous phases of the same layout), with the critical path."""
    if staleness not in STALENESS:
        raise ValueError(f"max_staleness must be 1 or 2, got {staleness}")
    t = _seconds_by_place(phases)
    lp, up, pr, sync = t[LOGPROBS], t[UPDATE], t[PROBES], t[SYNC]
    cold = f" ({t[COLD]:.0f} s of it re-prefilling the responses: the new weights reset the prefix cache)" if t[COLD] else ""
    gen = t[DECODE] + t[REWARDS]
    if staleness == 1:
        serial = lp + pr
        engine_side = gen
        steps = f"log-probs + entropy {lp:.0f} s (ranks)"
        steps += f" -> probes {pr:.0f} s{cold} (engines)" if pr else ""
        steps += " -> "
        engine_what = f"decode + rewards of batch t+1 {gen:.0f} s"
    else:
        serial = lp
        engine_side = pr + gen
        steps = f"log-probs + entropy of batch t+1 {lp:.0f} s (ranks) -> "
        engine_what = (f"probes of t+1 {pr:.0f} s{cold} + decode + rewards of t+2 {gen:.0f} s" if pr else
                       f"decode + rewards of batch t+2 {gen:.0f} s")
    seconds = serial + max(up, engine_side) + sync
    if engine_side >= up:
        par = f"[engines: {engine_what} || ranks: update {up:.0f} s, then wait {engine_side - up:.0f} s]"
        who = "the engines are the bottleneck"
    else:
        par = f"[ranks: update {up:.0f} s || engines: {engine_what}, then wait {up - engine_side:.0f} s]"
        who = "the ranks are the bottleneck"
    how = f"{steps}{par} -> weight sync {sync:.0f} s; {who}"
    if staleness == 2:  # what the second update of staleness buys: the probes hidden behind the update's slack
        saved = (lp + pr + max(up, gen) + sync) - seconds
        how += f"; {max(saved, 0.0):.0f} s less than at max_staleness 1" + (
            " (decode + rewards already outlast the update, so the probes stay on the critical path)" if saved < 0.5 and pr else "")
    return AsyncStep(staleness, seconds, engine_busy=pr + gen + sync, rank_busy=lp + up + sync, how=how)
