"""The training job's configuration: YAML presets plus OpenRLHF-style dotted flags, validated up front.

Sections map to dotted flags: ``--data.prompt_data``, ``--rollout.n_samples_per_prompt``,
``--actor.eps_clip_low_high 0.2 0.28``, ``--megatron.tensor_model_parallel_size``, ``--shape.alpha``,
``--reward.remote_url``, ``--trainer.num_steps``, and the alias ``--algo.advantage.estimator``
(= ``--shape.estimator``). A YAML file uses the same names nested by section. Every error names the
flag and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from openrlhf_shape.algorithms.config import ShapeConfig


@dataclass
class DataSection:
    prompt_data: str = "bundled:train"  # a .jsonl/.json/.parquet path, an HF dataset id, or bundled:train|test
    input_key: str = "question"
    label_key: str = "answer"
    apply_chat_template: bool = True
    input_template: str | None = None
    system_prompt: str | None = None
    max_prompt_len: int = 1024
    max_samples: int | None = None
    eval_data: str | None = None  # held-out prompts for periodic eval (same keys)
    eval_max_samples: int | None = 64


@dataclass
class RolloutSection:
    n_samples_per_prompt: int = 8
    rollout_batch_size: int = 128  # prompts per step
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8192
    num_engines: int = 1
    engine_tensor_parallel_size: int = 1
    kv_cache_gib: float = 2.0  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.6
    block_size: int | None = None  # None: 32 on CPU, vLLM's default on GPU
    dtype: str = "auto"  # auto: float32 on CPU (vllm-cpu would silently run float32 checkpoints in bf16), model dtype on GPU
    max_model_len: int | None = None  # None: max_prompt_len + max_new_tokens + probe room
    num_cpus_per_engine: float = 0.5
    colocate: bool = False  # GPU: vLLM sleeps while Megatron trains on the same GPUs
    dynamic_filtering: bool = False  # DAPO: drop groups whose samples all got the same reward
    weight_sync_bucket_mb: int = 256


@dataclass
class ActorSection:
    pretrain: str = "demo"  # an HF model directory, or "demo" for the bundled SmolLM2-135M-Instruct
    train_batch_size: int = 256  # samples per optimizer step (mini-batch); the rollout batch is split into these
    max_epochs: int = 1  # passes over each rollout batch
    learning_rate: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_ratio: float = 0.0
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    max_norm: float = 1.0
    eps_clip_low_high: tuple[float, float] = (0.2, 0.28)
    dual_clip: float | None = None
    micro_batch_max_tokens: int = 16384
    entropy_chunk_size: int = 1024
    num_cpus_per_rank: float = 0.5


@dataclass
class MegatronSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int = 1  # total actor ranks = TP x PP x DP
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_activations: bool = False
    gpus_per_rank: float = 1.0  # on GPU clusters; 0 on CPU


@dataclass
class ProbeSection:
    temperature: float = 1.0
    top_p: float = 1.0
    think_suffix: str = "\n\nTime is up. I should stop thinking and give the final answer now.\n</think>\n\nThe final answer is $\\boxed{"
    answer_suffix: str = "\n\nThe final answer is $\\boxed{"
    # adaptive probe budget (off: the paper's fixed m = --shape.num_probes); see docs/adaptive_probes.md
    adaptive: bool = False
    adaptive_tol: float = 0.13  # stop a state once the Jeffreys posterior sd of Phi is <= this
    max_probes: int = 0  # cap on samples per state; 0 = --shape.num_probes
    adaptive_first_round: int = 4
    adaptive_round_size: int = 4


@dataclass
class RewardSection:
    remote_url: str | None = None  # a .py with reward_func, or an http(s) endpoint; None = Math-Verify
    num_workers: int = 0  # Math-Verify processes; 0 = one per CPU core this process may use
    fast_probe_scoring: bool = True  # each distinct (probe answer, label) verified once; integers exact
    timeout_s: float = 5.0
    max_chars: int = 20000


@dataclass
class TrainerSection:
    output_dir: str = "runs/shape"
    num_steps: int = 360
    save_steps: int = 20  # 0 disables periodic checkpoints (a final one is always written)
    max_ckpts_keep: int = 3
    eval_steps: int = 0  # 0 disables periodic eval
    resume: str = "auto"  # auto | none | a checkpoint directory
    seed: int = 42
    ray_address: str | None = None  # None: start a local Ray; "auto": join `ray start --head`
    use_tensorboard: bool = False
    wandb_project: str | None = None
    export_hf: bool = True
    log_samples: int = 2  # responses printed per step (0: none)
    stop_after_steps: int | None = None  # run at most this many steps in this invocation (tests, time limits)


@dataclass
class TrainConfig:
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    actor: ActorSection = field(default_factory=ActorSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    probe: ProbeSection = field(default_factory=ProbeSection)
    reward: RewardSection = field(default_factory=RewardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)

    def validate(self) -> "TrainConfig":
        """Checks that need no model or devices; :func:`validate_against_model` does the rest."""
        d, r, a, m, t = self.data, self.rollout, self.actor, self.megatron, self.trainer
        self.shape.validate()

        def need(cond: bool, flag: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"--{flag}: {msg}")

        need(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1")
        if self.shape.estimator == "grpo" or self.shape.outcome_baseline != "none":
            need(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt",
                 "GRPO and group baselines need >= 2 samples per prompt")
        need(r.rollout_batch_size >= 1, "rollout.rollout_batch_size", "must be >= 1 prompt per step")
        need(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        need(r.num_engines >= 1, "rollout.num_engines", "must be >= 1")
        need(r.temperature > 0, "rollout.temperature", "must be > 0 (entropy is taken at this temperature)")
        need(0 < r.top_p <= 1, "rollout.top_p", "must lie in (0, 1]")
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        need(a.train_batch_size >= 1, "actor.train_batch_size", "must be >= 1")
        need(
            samples % a.train_batch_size == 0 or r.dynamic_filtering,
            "actor.train_batch_size",
            f"{a.train_batch_size} must divide rollout_batch_size x n_samples_per_prompt = {samples} "
            f"(e.g. --actor.train_batch_size {samples})",
        )
        need(a.max_epochs >= 1, "actor.max_epochs", "must be >= 1")
        lo, hi = a.eps_clip_low_high
        need(0 <= lo < 1 and hi >= 0, "actor.eps_clip_low_high", f"need 0 <= low < 1 and high >= 0, got {lo} {hi}")
        need(a.learning_rate > 0, "actor.learning_rate", "must be > 0")
        need(m.world_size >= 1, "megatron.world_size", "must be >= 1")
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        need(
            m.world_size % mp == 0,
            "megatron.world_size",
            f"{m.world_size} is not a multiple of TP x PP = {mp}; set --megatron.world_size to TP x PP x DP",
        )
        dp = m.world_size // mp
        need(
            a.train_batch_size % dp == 0,
            "actor.train_batch_size",
            f"{a.train_batch_size} is not divisible by the data-parallel size {dp} (world / (TP x PP))",
        )
        need(d.max_prompt_len >= 1, "data.max_prompt_len", "must be >= 1 token")
        need(t.num_steps >= 1, "trainer.num_steps", "must be >= 1")
        need(t.save_steps >= 0 and t.eval_steps >= 0, "trainer.save_steps", "save/eval steps must be >= 0")
        need(t.max_ckpts_keep >= 1, "trainer.max_ckpts_keep", "must keep at least 1 checkpoint")
        need(t.resume == "auto" or t.resume == "none" or os.path.isdir(t.resume), "trainer.resume",
             f"{t.resume!r} is neither 'auto', 'none' nor an existing checkpoint directory")
        self._validate_probes()
        if r.colocate:
            need(m.gpus_per_rank > 0, "rollout.colocate", "colocation only applies on GPU (set --megatron.gpus_per_rank)")
        if d.prompt_data.startswith("bundled:"):
            need(d.prompt_data in ("bundled:train", "bundled:test"), "data.prompt_data",
                 "bundled data is 'bundled:train' or 'bundled:test'")
        elif not os.path.exists(d.prompt_data) and d.prompt_data.endswith((".jsonl", ".json", ".parquet")):
            raise FileNotFoundError(f"--data.prompt_data: file {d.prompt_data} does not exist")
        if a.pretrain != "demo" and not os.path.isdir(a.pretrain):
            raise FileNotFoundError(
                f"--actor.pretrain: {a.pretrain} is not a Hugging Face model directory (or use 'demo')"
            )
        return self

    def _validate_probes(self) -> None:
        p, sh = self.probe, self.shape
        if p.max_probes < 0:
            raise ValueError(f"--probe.max_probes: must be >= 0 (0 = --shape.num_probes), got {p.max_probes}")
        if self.reward.num_workers < 0:
            raise ValueError(f"--reward.num_workers: must be >= 1, or 0 for one per core; got {self.reward.num_workers}")
        if not p.adaptive:
            return
        from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule

        cap = p.max_probes or sh.num_probes
        AdaptiveProbeRule(min(p.adaptive_first_round, cap), p.adaptive_round_size, cap, p.adaptive_tol)  # names the flag
        g = sh.gamma_min if sh.fixed_gamma is None else sh.fixed_gamma
        if sh.estimator == "shape" and not sh.allow_unsafe_hparams and g <= (cap - 1) / cap:
            raise ValueError(
                f"--probe.max_probes: up to {cap} probes per state make Phi = {cap - 1}/{cap} possible, and a step "
                f"from there to 1 needs gamma > {(cap - 1) / cap:.4f} for a positive shaping reward (paper appendix "
                f"A.2); gamma is {g}. Lower --probe.max_probes, raise --shape.gamma_min, or pass "
                "--shape.allow_unsafe_hparams"
            )

    def max_model_len(self) -> int:
        if self.rollout.max_model_len:
            return int(self.rollout.max_model_len)
        return int(self.data.max_prompt_len + self.rollout.max_new_tokens + 64 + self.shape.probe_max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- parsing

ALIASES = {
    "algo.advantage.estimator": "shape.estimator",
    "data.prompt_dataset": "data.prompt_data",
    "actor.lr": "actor.learning_rate",
    "rollout.generate_max_len": "rollout.max_new_tokens",
    "actor.micro_train_batch_size_tokens": "actor.micro_batch_max_tokens",
}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in hints}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "extra"}


def _all_flags() -> list[str]:
    return [f"{s}.{k}" for s, cls in _section_types().items() for k in _field_types(cls)]


def _convert(value: Any, tp: Any, flag: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        return _convert(value, non_none[0], flag)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true/false, got {value!r}")
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if origin is tuple:
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            if len(items) != len(args):
                raise ValueError(f"expected {len(args)} values, got {len(items)}")
            return tuple(_convert(v, a, flag) for v, a in zip(items, args))
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ValueError("expected a mapping")
            return value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--{flag}: {exc}") from None
    return value


def _set(cfg_dict: dict[str, dict[str, Any]], flag: str, value: Any) -> None:
    flag = ALIASES.get(flag, flag)
    parts = flag.split(".")
    sections = _section_types()
    if len(parts) != 2 or parts[0] not in sections or parts[1] not in _field_types(sections[parts[0]]):
        close = difflib.get_close_matches(flag, _all_flags() + list(ALIASES), n=3)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        raise ValueError(f"unknown option --{flag}{hint}")
    tp = _field_types(sections[parts[0]])[parts[1]]
    cfg_dict.setdefault(parts[0], {})[parts[1]] = _convert(value, tp, flag)


def _flatten_yaml(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not (name in _all_flags()):
            out.extend(_flatten_yaml(value, name + "."))
        else:
            out.append((name, value))
    return out


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """``['--a.b', '1', '--c.d=x', '--e.f', '0.2', '0.28', '--flag']`` -> [(flag, value)].

    A flag followed by several non-flag tokens collects a list (for tuples); a bare flag means true.
    """
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) < 3:
            raise ValueError(f"unexpected argument {tok!r}: options look like --section.name VALUE")
        name = tok[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            out.append((name, value))
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not (argv[i].startswith("--") and len(argv[i]) > 2 and not _is_number(argv[i])):
            values.append(argv[i])
            i += 1
        out.append((name, True if not values else values[0] if len(values) == 1 else values))
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def load_config(yaml_path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- dotted flags; returns a validated :class:`TrainConfig`."""
    cfg_dict: dict[str, dict[str, Any]] = {}
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise FileNotFoundError(f"--config: {yaml_path} does not exist (presets live in configs/)")
        with open(yaml_path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config: {yaml_path} must hold a mapping of sections")
        for flag, value in _flatten_yaml(data):
            try:
                _set(cfg_dict, flag, value)
            except ValueError as exc:
                raise ValueError(f"{yaml_path}: {exc}") from None
    for flag, value in parse_overrides(list(overrides or [])):
        _set(cfg_dict, flag, value)
    sections = _section_types()
    built = {}
    for name, cls in sections.items():
        try:
            built[name] = cls(**cfg_dict.get(name, {}))
        except ValueError:
            raise
        except TypeError as exc:
            raise ValueError(f"--{name}.*: {exc}") from None
    return TrainConfig(**built).validate()
