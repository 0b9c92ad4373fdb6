"""Helpers for tests/eval (imported by module name: tests/eval is on sys.path under pytest)."""

from __future__ import annotations

import json
from pathlib import Path

from openrlhf_shape.rollout.engine import Generation
from support.modules import load_file


class ScriptedBackend:
    """Implements the engine's ``generate`` contract with known responses (not a vLLM stand-in: it
    is the eval's generation protocol fed from a script, to check the arithmetic exactly).

    ``script[question]`` = list of (text, num_tokens, finish_reason), one per sample. The question
    is found in the decoded prompt. ``calls`` records the questions of every generate call (each question
    once). With ``request_seeds`` (the runner's seeded path) each sample is its own n = 1 request: the k-th
    request of a question in a call gets the script's k-th sample; ``seeds`` records the seeds per question.
    """

    def __init__(self, tokenizer, script: dict[str, list[tuple[str, int, str]]]):
        self.tok = tokenizer
        self.script = script
        self.calls: list[list[str]] = []
        self.seeds: dict[str, list[int]] = {}

    def generate(self, prompt_token_ids, sampling, request_seeds=None):
        out, asked = [], []
        for i, ids in enumerate(prompt_token_ids):
            text = self.tok.decode(ids)
            matches = [q for q in self.script if q in text]
            assert len(matches) == 1, f"prompt matches {matches}: {text!r}"
            samples = self.script[matches[0]]
            if request_seeds is None:
                assert len(samples) == sampling.n
                chosen = list(enumerate(samples))
            else:
                assert sampling.n == 1 and len(request_seeds) == len(prompt_token_ids)
                k = asked.count(matches[0])
                chosen = [(0, samples[k])]
                self.seeds.setdefault(matches[0], []).append(request_seeds[i])
            asked.append(matches[0])
            for j, (resp, ntok, reason) in chosen:
                out.append(Generation(i, j, list(range(ntok)), resp, reason, None, len(ids), 0))
        self.calls.append(list(dict.fromkeys(asked)))
        return out


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_script(name: str):
    """A script of ``scripts/`` (``name`` without ``.py``) imported as a module (scripts are not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    return load_file(path)
