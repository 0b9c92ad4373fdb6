"""Run logging: metrics.jsonl (always), run.json, TensorBoard and W&B when asked, console lines."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Any

log = logging.getLogger("openrlhf_shape")


def setup_console_logging(verbose: bool = False) -> None:
    """The project logger on the terminal: INFO lines (DEBUG too with ``verbose``). The logger
    itself passes DEBUG so that a run's log file (trainer/console.py) gets everything."""
    handler = next((h for h in log.handlers if getattr(h, "_openrlhf_shape_console", False)), None)
    if handler is None:
        handler = logging.StreamHandler(getattr(sys.stderr, "console", sys.stderr))  # never our own filter
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        handler._openrlhf_shape_console = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.setLevel(logging.DEBUG)
    log.propagate = False


def code_version() -> dict | None:
    """The commit of the checkout this package runs from, and whether it had uncommitted changes to
    tracked files: ``{"commit": sha, "dirty": bool}``; None outside a git checkout (an installed wheel).
    A result is only as good as the code that made it, so run.json records it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _jsonable(v: Any) -> Any:
    """A metric value as JSON: tensors / numpy values become numbers or lists, non-finite floats
    become strings ("nan", "inf"), containers are converted element-wise."""
    if hasattr(v, "detach"):  # torch tensor (any shape)
        v = v.detach().cpu()
        return _jsonable(v.item() if v.numel() == 1 else v.tolist())
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # numpy array / scalar
        return _jsonable(v.tolist())
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def checkpoint_row(step_metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics line of a step as its checkpoint keeps it (in the checkpoint's ``extra``): what the step logged
    before the checkpoint phase, at this time, marked ``resume/line_from_checkpoint``. The checkpoint's own time, the
    step's total time and the idle shares are not in it (the checkpoint phase had not finished)."""
    return {"time": time.time(), **{k: _jsonable(v) for k, v in step_metrics.items()}, "resume/line_from_checkpoint": 1.0}


class MetricsLogger:
    """Appends one JSON object per step to ``<run>/metrics.jsonl`` and mirrors scalars elsewhere.

    The JSONL file is flushed and fsynced every step, so a crash loses at most the running step.
    On resume, lines of steps after the checkpoint are dropped (they will be redone). A step's checkpoint is written
    before its line (the line reports the checkpoint), so a run stopped between the two resumes from a step that has
    no line: ``resume_row``, the line as the checkpoint kept it (:func:`checkpoint_row`), is written then.
    """

    def __init__(self, run_dir: str, run_info: dict, tensorboard: bool = False, wandb_project: str | None = None,
                 resume_step: int | None = None, tensorboard_dir: str | None = None, wandb_kwargs: dict | None = None,
                 resume_row: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.resumed_rows: list[dict] = []  # on resume: the steps up to the checkpoint, as logged
        info_path = os.path.join(run_dir, "run.json")
        if resume_step is not None and os.path.exists(info_path):  # the code of every segment of the run
            with open(info_path) as f:
                run_info = {**run_info, "code": json.load(f).get("code", []) + run_info.get("code", [])}
        tmp = info_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(run_info, f, indent=2, default=str)
        os.replace(tmp, info_path)
        if resume_step is not None and os.path.exists(self.path):
            self._truncate_after(resume_step)
        elif resume_step is None and os.path.exists(self.path):
            os.replace(self.path, self.path + f".{int(time.time())}.old")
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--logger.tensorboard_dir needs the tensorboard package (pip install tensorboard)") from exc
            self._tb = SummaryWriter(tensorboard_dir or os.path.join(run_dir, "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("--logger.wandb.project needs the wandb package (pip install wandb)") from exc
            extra = {k: v for k, v in (wandb_kwargs or {}).items() if v}
            extra.setdefault("name", run_info.get("name"))
            self._wandb = wandb.init(project=wandb_project, config=run_info.get("config"), **extra)
        if resume_step and resume_row and not any(r.get("step") == resume_step for r in self.resumed_rows):
            record = {**resume_row, "step": resume_step}
            self._write(record)
            self.resumed_rows.append(record)

    def _truncate_after(self, step: int) -> None:
        with open(self.path) as f:
            lines = [ln for ln in f if ln.strip()]
        kept = []
        for ln in lines:
            try:
                record = json.loads(ln)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if record.get("step", 0) <= step:
                kept.append(ln)
                self.resumed_rows.append(record)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._write({"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}})

    def _write(self, record: dict[str, Any]) -> None:
        """One line (flushed, fsynced) and its scalars to TensorBoard / W&B."""
        step = record["step"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
