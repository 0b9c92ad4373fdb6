"""examples/scripts/train_shape_qwen3.sh (and its GRPO / MRT wrappers) turn MODEL into a preset and run the trainer:
run here with ``--dry_run`` (the planner's sizing of the preset on its H100 cluster; nothing starts), for a dense
and both mixture-of-experts models of the README, and refused with the list of presets for a model without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "scripts"


def _run(script: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """The script as a user runs it (bash, the venv's ``openrlhf-shape`` on PATH), with this checkout's package."""
    full = {**os.environ, **env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(["bash", str(SCRIPTS / script), *flags], capture_output=True, text=True, env=full,
                          timeout=300, cwd=str(REPO))


@pytest.mark.parametrize("model, layout", [
    ("Qwen3-30B-A3B", "experts: EP 8 x expert TP 2 x PP 1 x expert DP 1"),
    ("Qwen3-235B-A22B", "experts: EP 16 x expert TP 4 x PP 2 x expert DP 1"),
    ("Qwen3-8B", "Qwen3-8B"),
])
def test_the_readme_command_reaches_each_preset(model, layout):
    proc = _run("train_shape_qwen3.sh", {"MODEL": model, "MODEL_PATH": f"/models/{model}", "DATA": "/data/train.parquet"},
                "--dry_run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"configs/{model.lower()}.yaml" in proc.stdout and layout in proc.stdout


def test_the_wrappers_pass_their_estimator_and_the_flags_through():
    env = {"MODEL": "Qwen3-30B-A3B", "MODEL_PATH": "/models/Qwen3-30B-A3B"}
    shape = _run("train_shape_qwen3.sh", env, "--dry_run")
    grpo = _run("train_grpo_qwen3.sh", env, "--dry_run")
    assert shape.returncode == grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    # SHAPE probes K x m = 16 x 8 states per response; GRPO (ESTIMATOR=grpo from the wrapper) none
    assert "'probes_per_response': 128" in shape.stdout and "'probes_per_response': 0" in grpo.stdout
    # an extra dotted flag overrides the preset: an expert layout megatron-core cannot build is refused by name
    bad = _run("train_shape_qwen3.sh", env, "--megatron.expert_tensor_parallel_size", "3", "--dry_run")
    assert bad.returncode == 2 and "--megatron.expert_tensor_parallel_size" in bad.stdout


def test_a_model_without_a_preset_is_refused_with_the_presets():
    proc = _run("train_shape_qwen3.sh", {"MODEL": "Qwen3-7B"}, "--dry_run")
    assert proc.returncode == 2
    assert "got 'Qwen3-7B'" in proc.stderr
    for model in ("Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B", "Qwen3-30B-A3B", "Qwen3-235B-A22B"):
        assert model in proc.stderr
    assert _run("train_shape_qwen3.sh", {"MODEL": "../configs/cpu-smoke"}, "--dry_run").returncode == 2
