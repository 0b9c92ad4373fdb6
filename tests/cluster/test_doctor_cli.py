"""``openrlhf-shape doctor`` as a user runs it, on a local Ray: every check printed, exit 0 when all pass;
an output directory no node can write fails the run (exit 1) naming the flag. (The multi-node checks
run on the simulated cluster: test_simulated_cluster.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doctor(out_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "doctor", "--config", "configs/cpu-smoke.yaml",
                           "--ckpt.output_dir", out_dir], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_doctor_cli(tmp_path) -> None:
    ok = _doctor(str(tmp_path / "out"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for line in ("[ok] nodes:", "[ok] placement:", "[ok] rendezvous:", "[ok] shared path --ckpt.output_dir:",
                 "[ok] placement released:", "doctor: 6 ok, 0 failed",
                 "doctor: recovery per engine failure (--rollout.max_engine_restarts): ~",
                 "doctor: recovery per rank failure (--train.max_restarts): ~"):
        assert line in ok.stdout, ok.stdout

    (tmp_path / "file").write_text("x")
    bad = _doctor(str(tmp_path / "file" / "out"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "[FAIL] shared path --ckpt.output_dir:" in bad.stdout and "failed (shared path --ckpt.output_dir)" in bad.stdout
