"""Evaluation configuration: benchmarks, the paper's protocol preset, a CPU preset, validation.

Paper protocol (appendix B.1.2): T = 0.6, top-p 0.95, top-k 40, at most 32,768 new tokens,
Math-Verify scoring, N samples per problem by benchmark (Table 7):

    AIME 2024: 32   AIME 2025: 32   AMC 2023: 32   MinervaMATH: 4   MATH-500: 2

Precedence of N for one benchmark: ``EvalConfig.n_samples`` (global override, ``--n_samples``) >
``BenchmarkSpec.n_samples`` > the preset. Precedence of the token limit: ``max_new_tokens`` >
the preset.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from openrlhf_shape.rewards.computer import RewardConfig
from openrlhf_shape.rollout.engine import EngineConfig

# Normalised benchmark name (lower case, letters and digits only) -> N of the paper's Table 7.
PAPER_N_SAMPLES: dict[str, int] = {
    "aime2024": 32,
    "aime24": 32,
    "aime2025": 32,
    "aime25": 32,
    "amc2023": 32,
    "amc23": 32,
    "minerva": 4,
    "minervamath": 4,
    "math500": 2,
}

# "{question}" is replaced literally (no str.format, so LaTeX braces need no escaping).
DEFAULT_PROMPT_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Preset:
    """Sampling defaults. ``n_by_benchmark`` maps normalised names to N; ``default_n`` is used for
    names not in it (None: unknown names are an error)."""

    name: str
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    n_by_benchmark: dict[str, int]
    default_n: int | None
    chunk_sequences: int  # sequences per engine per generate call when --chunk_size is not given


PRESETS: dict[str, Preset] = {
    "paper": Preset("paper", 0.6, 0.95, 40, 32768, PAPER_N_SAMPLES, None, 512),
    # Same sampling, but short answers and N = 2 everywhere: a CPU smoke of the protocol.
    # Small generate calls so an interrupted CPU run loses little.
    "cpu": Preset("cpu", 0.6, 0.95, 40, 256, {}, 2, 16),
}


def _eval_engine() -> EngineConfig:
    return EngineConfig(gpu_memory_utilization=0.9, max_model_len=None)


def normalize_benchmark_name(name: str) -> str:
    """'AIME 2024' / 'aime_24' / 'MATH-500' -> 'aime2024' / 'aime24' / 'math500'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


@dataclass
class BenchmarkSpec:
    """One benchmark: a local .jsonl/.json/.parquet file or a Hugging Face dataset id.

    ``source`` may end in ``@split`` for an HF id (default split "test"). ``input_key`` /
    ``label_key`` name the question and reference-answer fields; ``id_key`` names a problem id
    field (default: the row index); ``difficulty_key`` is copied into the per-problem results.
    """

    name: str
    source: str
    input_key: str = "problem"
    label_key: str = "answer"
    id_key: str | None = None
    difficulty_key: str | None = "difficulty"
    n_samples: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(
                f"benchmark name {self.name!r}: use letters, digits, '_', '-', '.' only "
                "(it names files in the output directory)"
            )
        if not self.source:
            raise ValueError(f"benchmark {self.name!r}: empty source; pass a file path or an HF dataset id")
        if self.n_samples is not None and self.n_samples < 1:
            raise ValueError(f"benchmark {self.name!r}: n_samples must be >= 1, got {self.n_samples}")


@dataclass
class EvalConfig:
    """Everything ``evaluate`` needs. ``model_path``: an HF model directory or one of our Megatron
    checkpoints (exported to HF on the fly into ``out_dir/exported_hf``)."""

    model_path: str
    benchmarks: list[BenchmarkSpec]
    out_dir: str
    preset: str = "paper"
    n_samples: int | None = None  # global override of N for every benchmark
    max_new_tokens: int | None = None  # override of the preset's token limit
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    apply_chat_template: bool = True
    system_prompt: str | None = None
    limit: int | None = None  # first `limit` problems of every benchmark (smoke runs)
    # Engines: `num_engines` vLLM engines (Ray actors when > 1), each built from `engine`
    # (model_path is set at run time; max_model_len None = longest prompt + max_new_tokens).
    num_engines: int = 1
    engine: EngineConfig = field(default_factory=_eval_engine)
    # Problems per generate call (results are saved after every call, the resume granularity).
    # None: the preset's sequences per engine per call: max(1, chunk_sequences * num_engines // N).
    chunk_size: int | None = None
    # Scoring: training's answer reward path (Math-Verify: scorer.num_workers processes, scorer.timeout_s per answer;
    # or the reward function / server of scorer.remote_url, whose `scores` count) and statistics.
    scorer: RewardConfig = field(default_factory=RewardConfig)
    bootstrap_samples: int = 1000
    confidence: float = 0.95
    bootstrap_seed: int = 0
    save_responses: bool = True
    overwrite: bool = False  # drop earlier results in out_dir instead of resuming

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {sorted(PRESETS)}")
        if not self.benchmarks:
            raise ValueError("no benchmarks: pass at least one --benchmark NAME=SOURCE")
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"--benchmark names must be unique, got {names}")
        for flag in ("n_samples", "max_new_tokens", "limit"):
            v = getattr(self, flag)
            if v is not None and v < 1:
                raise ValueError(f"--{flag} must be >= 1, got {v}")
        if self.top_k is not None and not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"--top_k must be -1 (off, as the rollouts sample) or >= 1, got {self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.num_engines < 1:
            raise ValueError("--num_engines must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"--chunk_size must be >= 1, got {self.chunk_size}")
        from openrlhf_shape.data.prompts import check_template

        check_template(self.prompt_template, "--prompt_template")
        for b in self.benchmarks:
            self.n_for(b)  # raises early for a benchmark the preset cannot size

    @property
    def preset_obj(self) -> Preset:
        return PRESETS[self.preset]

    def n_for(self, bench: BenchmarkSpec) -> int:
        """N samples per problem for ``bench`` (global override > spec > preset)."""
        if self.n_samples is not None:
            return self.n_samples
        if bench.n_samples is not None:
            return bench.n_samples
        p = self.preset_obj
        n = p.n_by_benchmark.get(normalize_benchmark_name(bench.name), p.default_n)
        if n is None:
            known = ", ".join(sorted(p.n_by_benchmark))
            raise ValueError(
                f"benchmark {bench.name!r} is not one of the paper's ({known}); name it like one of "
                "those, or give its N with --n_samples (or BenchmarkSpec.n_samples)"
            )
        return n

    def chunk_for(self, bench: BenchmarkSpec) -> int:
        """Problems per generate call for ``bench``."""
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, self.preset_obj.chunk_sequences * self.num_engines // self.n_for(bench))

    def sampling_values(self) -> dict[str, Any]:
        """Resolved temperature / top_p / top_k / max_new_tokens (overrides > preset)."""
        p = self.preset_obj
        pick = lambda v, d: d if v is None else v  # noqa: E731
        return {
            "temperature": pick(self.temperature, p.temperature),
            "top_p": pick(self.top_p, p.top_p),
            "top_k": pick(self.top_k, p.top_k),
            "max_new_tokens": pick(self.max_new_tokens, p.max_new_tokens),
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_benchmark_arg(text: str) -> tuple[str, str]:
    """'aime24=/data/aime24.jsonl' -> ('aime24', '/data/aime24.jsonl')."""
    name, sep, source = text.partition("=")
    if not sep or not name or not source:
        raise ValueError(f"--benchmark {text!r}: expected NAME=SOURCE (a file or an HF dataset id)")
    return name.strip(), source.strip()


def parse_keys_arg(text: str) -> tuple[str, str, str]:
    """'minerva=problem,solution' -> ('minerva', 'problem', 'solution')."""
    name, sep, keys = text.partition("=")
    parts = keys.split(",")
    if not sep or len(parts) != 2 or not all(parts):
        raise ValueError(f"--benchmark_keys {text!r}: expected NAME=INPUT_KEY,LABEL_KEY")
    return name.strip(), parts[0].strip(), parts[1].strip()


def fingerprint(cfg: EvalConfig, bench: BenchmarkSpec) -> dict[str, Any]:
    """What must not change between a run and its resume for one benchmark's results to stay valid."""
    return {
        "model_path": cfg.model_path,
        "source": bench.source,
        "input_key": bench.input_key,
        "label_key": bench.label_key,
        "n_samples": cfg.n_for(bench),
        "prompt_template": cfg.prompt_template,
        "apply_chat_template": cfg.apply_chat_template,
        "system_prompt": cfg.system_prompt,
        "seed": cfg.engine.seed,
        **cfg.sampling_values(),
        # results judged by a reward function do not mix with Math-Verify's (older directories: Math-Verify, no key)
        **({"reward_remote_url": cfg.scorer.remote_url} if cfg.scorer.remote_url else {}),
    }


# The flat command line of ``openrlhf-shape eval``: flag -> field path of EvalConfig (generated
# into argparse by openrlhf_shape.cli.evaluate; types and defaults come from the dataclasses).
FLAT_FLAGS: dict[str, str] = {
    "n_samples": "n_samples",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "system_prompt": "system_prompt",
    "limit": "limit",
    "num_engines": "num_engines",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "kv_cache_gib": "engine.kv_cache_gib",
    "block_size": "engine.block_size",
    "max_model_len": "engine.max_model_len",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "chunk_size": "chunk_size",
    "scorer_workers": "scorer.num_workers",
    "scorer_timeout_s": "scorer.timeout_s",
    # training's answer reward path (rewards/computer.py): a reward_func file or HTTP server instead of Math-Verify
    "reward.remote_url": "scorer.remote_url",
    "reward.remote_timeout_s": "scorer.remote_timeout_s",
    "reward.remote_retries": "scorer.remote_retries",
    "reward.max_chars": "scorer.max_chars",
    "bootstrap_samples": "bootstrap_samples",
    "confidence": "confidence",
}


__all__ = [
    "FLAT_FLAGS",
    "BenchmarkSpec",
    "DEFAULT_PROMPT_TEMPLATE",
    "EvalConfig",
    "PAPER_N_SAMPLES",
    "PRESETS",
    "Preset",
    "fingerprint",
    "normalize_benchmark_name",
    "parse_benchmark_arg",
    "parse_keys_arg",
]
