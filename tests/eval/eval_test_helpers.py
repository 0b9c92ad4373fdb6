"""Helpers for tests/eval (imported by module name: tests/eval is on sys.path under pytest)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from openrlhf_shape.rollout.engine import Generation


class ScriptedBackend:
    """Implements the engine's ``generate`` contract with known responses (not a vLLM stand-in: it
    is the eval's generation protocol fed from a script, to check the arithmetic exactly).

    ``script[question]`` = list of (text, num_tokens, finish_reason), one per sample. The question
    is found in the decoded prompt. ``calls`` records the questions of every generate call.
    """

    def __init__(self, tokenizer, script: dict[str, list[tuple[str, int, str]]]):
        self.tok = tokenizer
        self.script = script
        self.calls: list[list[str]] = []

    def generate(self, prompt_token_ids, sampling):
        out, asked = [], []
        for i, ids in enumerate(prompt_token_ids):
            text = self.tok.decode(ids)
            matches = [q for q in self.script if q in text]
            assert len(matches) == 1, f"prompt matches {matches}: {text!r}"
            asked.append(matches[0])
            samples = self.script[matches[0]]
            assert len(samples) == sampling.n
            for j, (resp, ntok, reason) in enumerate(samples):
                out.append(Generation(i, j, list(range(ntok)), resp, reason, None, len(ids), 0))
        self.calls.append(asked)
        return out


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_script(name: str):
    """A script of ``scripts/`` (``name`` without ``.py``) imported as a module (scripts are not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
