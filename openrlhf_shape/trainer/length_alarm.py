"""A console alarm for length collapse: responses getting much shorter while training accuracy does not
rise (what the paper-form SHAPE did on the 135M demo model: wrong answers got ~0 advantage, the policy
sharpened toward short guesses). It never stops a run.

Training accuracy is noisy per step, so both quantities are compared as window means: the last ``window``
steps against the ``window`` steps before them. It fires (one warning line, and ``alarm/length_collapse``
= 1 in that step's metrics) when the mean length fell by more than ``fraction`` and the mean accuracy
did not rise; ``alarm/length_drop`` is that window-over-window drop, logged every step once two windows exist.
Set by ``--shape.length_alarm_fraction`` (0 = off) and ``--shape.length_alarm_window``. A resumed run
restores the windows from its logged steps (``restore``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openrlhf_shape.trainer.logging_utils import log

LENGTH = "rollout/response_length/mean"
ACCURACY = "rollout/accuracy"


@dataclass
class LengthCollapseAlarm:
    fraction: float = 0.3
    window: int = 3
    history: list[tuple[float, float]] = field(default_factory=list)  # (length, accuracy) per step

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"--shape.length_alarm_fraction {self.fraction}: use 0 (off) or a fraction in (0, 1)")
        if self.window < 1:
            raise ValueError(f"--shape.length_alarm_window {self.window}: use >= 1 step")

    def _record(self, metrics: dict) -> bool:
        """Append a step's (length, accuracy) to the history; False where the alarm is off or the step has
        no rollout (a filtered step, the step-0 eval row)."""
        length, acc = metrics.get(LENGTH), metrics.get(ACCURACY)
        if not self.fraction or not isinstance(length, (int, float)) or not isinstance(acc, (int, float)):
            return False
        self.history.append((float(length), float(acc)))
        return True

    def restore(self, rows: list[dict]) -> None:
        """The history of a resumed run from its logged steps (metrics.jsonl up to the checkpoint), so that
        after a resume the alarm says what the uninterrupted run would have said."""
        self.history.clear()
        for row in rows:
            self._record(row)

    def update(self, step: int, metrics: dict) -> str | None:
        """Record this step's mean length and accuracy; returns (and logs) the alarm line or None."""
        if not self._record(metrics):
            return None
        w = self.window
        if len(self.history) < 2 * w:
            metrics["alarm/length_collapse"] = 0.0
            return None
        before, recent = self.history[-2 * w : -w], self.history[-w:]
        len_before, len_recent = (sum(h[0] for h in x) / w for x in (before, recent))
        acc_before, acc_recent = (sum(h[1] for h in x) / w for x in (before, recent))
        drop = 1.0 - len_recent / len_before if len_before > 0 else 0.0
        fired = drop > self.fraction and acc_recent <= acc_before
        metrics["alarm/length_collapse"] = float(fired)
        metrics["alarm/length_drop"] = drop  # what the alarm compares with the fraction (negative: longer)
        if not fired:
            return None
        msg = (f"step {step}: length collapse? mean response length {len_before:.0f} -> {len_recent:.0f} tokens "
               f"(-{100 * drop:.0f}%, over the last {w} steps vs the {w} before) while training accuracy went "
               f"{acc_before:.2f} -> {acc_recent:.2f}; see adv/wrong/mean (wrong answers near 0 advantage get no "
               "push away), shape/shaping_to_outcome, and shape/length_tax/mean with shape/sign_reversal_rate (what the "
               "length discount gamma_k takes; progress penalised below gamma_min (m-1)/m)")
        log.warning(msg)
        return msg
