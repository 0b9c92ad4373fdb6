"""The training job's configuration: YAML presets plus dotted flags, validated up front.

``TrainConfig`` composes the component configs (each field declared once, in its component):
``data`` (:class:`PromptDataConfig` + held-out data), ``sampling`` (:class:`SamplingConfig`),
``engine`` (:class:`EngineConfig`), ``rollout`` (batch and engine count), ``actor`` (model and
mini-batching), ``megatron`` (:class:`MegatronConfig` + rank count), ``shape``
(:class:`ShapeConfig`), ``probe`` (:class:`ProbeConfig`), ``reward`` (:class:`RewardConfig`) and
``trainer`` (the loop). Every leaf is a dotted flag (``--megatron.adam_beta2 0.98``,
``--engine.enforce_eager true``). Users give OpenRLHF 0.11's names wherever the meaning is the same
(``--actor.model_name_or_path``, ``--rollout.batch_size``, ``--train.batch_size``, ``--vllm.num_engines``,
``--ckpt.output_dir``, ``--algo.advantage.*``; trainer/flag_translation.py: OpenRLHF flags for parts
we do not have are refused there, and the previous release's names print a deprecation line);
:data:`ALIASES` maps those public names onto the fields. A YAML file uses the same names nested by
dots. Every error names the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.config_flags import Alias, FlagSpace, flatten_mapping, parse_overrides  # noqa: F401
from openrlhf_shape.data.prompts import PromptDataConfig
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.rewards.computer import RewardConfig
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.trainer.flag_translation import DEFAULT_MAX_PROMPT_LEN, PUBLIC, public_name, translate


@dataclass
class DataSection(PromptDataConfig):
    """Training prompts (the :class:`PromptDataConfig` fields) plus the held-out prompts."""

    eval_data: str | None = None  # held-out prompts for periodic eval (same keys)
    eval_max_samples: int | None = 64
    eval_split: str = "train"  # split of an HF dataset for the held-out prompts

    @property
    def prompt_data(self) -> str:
        """The training prompts (``--data.prompt_data`` = ``--data.prompt_dataset``)."""
        return self.prompt_dataset


@dataclass
class RolloutSection:
    """How much is generated per step and by how many engines (sampling is ``sampling.*``)."""

    rollout_batch_size: int = 128  # prompts per step
    num_engines: int = 1
    num_cpus_per_engine: float = 0.5
    colocate: bool = False  # GPU: vLLM sleeps while Megatron trains on the same GPUs
    dynamic_filtering: bool = False  # DAPO: drop prompt groups whose mean score is not strictly inside the range
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    weight_sync_bucket_mb: int = 256
    # Rollout/trainer log-prob gap (mean |dlogp|, nats) past which the run STOPS; 0 = warn only, past the
    # dtype's expectation (openrlhf_shape/trainer/logprob_guard.py: 5e-5 float32, 5e-2 bf16).
    max_logprob_gap: float = 0.0
    # rollout/trainer mismatch correction (OpenRLHF's --algo.advantage.is_correction_*; algorithms/rollout_correction.py)
    is_correction_level: str = "off"  # off | token | seq
    is_correction_mode: str = "mask"  # mask | clip
    is_correction_gating: str = "ratio"  # ratio | binary_kl | tv
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)
    # auto (decided per plan: cluster/placement.py:resolve_weight_sync) | collective (gloo on CPU, NCCL on GPU)
    # | object_store | cuda_ipc
    weight_sync: str = "auto"
    # Seconds any one weight sync (and the sync group's forming) may take, and every wait inside it: past
    # it, or as soon as an engine dies mid-sync, the run stops naming the engine (a hang otherwise).
    weight_sync_timeout: float = 600.0
    num_gpus: int | None = None  # disaggregated engine pool; None: num_engines x engine_tensor_parallel_size


@dataclass
class ActorSection:
    """The policy model and how a rollout batch is cut into optimizer steps."""

    pretrain: str = "demo"  # an HF model directory, or "demo" for the bundled SmolLM2-135M-Instruct
    backend: str = "megatron"  # megatron (TP/PP/DP, openrlhf_shape/megatron) | deepspeed (ZeRO DP, openrlhf_shape/zero)
    train_batch_size: int = 256  # samples per optimizer step (mini-batch); the rollout batch is split into these
    max_epochs: int = 1  # passes over each rollout batch
    num_cpus_per_rank: float = 0.5


@dataclass
class MegatronSection(MegatronConfig):
    """The actor backend (:class:`MegatronConfig`) plus how many ranks run it."""

    world_size: int = 1  # total actor ranks = TP x PP x DP
    gpus_per_rank: float = 1.0  # on GPU clusters; 0 on CPU
    min_lr_ratio: float | None = None  # min lr = ratio x lr (OpenRLHF's --actor.min_lr_ratio); wins over min_lr

    def backend_config(self, total_steps: int, seed: int) -> MegatronConfig:
        """The rank-side :class:`MegatronConfig` with the schedule length and seed filled in."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(MegatronConfig)}
        if self.min_lr_ratio is not None:
            own["min_lr"] = self.min_lr_ratio * self.lr
        return MegatronConfig(**{**own, "total_steps": total_steps, "seed": seed})


@dataclass
class DeepSpeedSection:
    """The DeepSpeed actor backend (``--actor.backend deepspeed``; openrlhf_shape/zero). The optimiser,
    schedule, micro-batching and loss settings are shared with Megatron (``actor.*``, ``train.*``)."""

    zero_stage: int = 2  # 0 plain DP, 1 optimizer states sharded, 2 + gradients, 3 + parameters
    adam_offload: bool = False  # Adam moments and fp32 masters in host memory (DeepSpeedCPUAdam)
    param_dtype: str = "auto"  # auto (bf16 on GPU ranks, fp32 on CPU) | bf16 | fp32
    zero3_param_persistence_threshold: int = 100_000  # ZeRO-3: tensors smaller than this stay whole
    attn_implementation: str = "sdpa"  # the Hugging Face attention kernel (sdpa | flash_attention_2 | eager)


@dataclass
class TrainerSection:
    output_dir: str = "runs/shape"
    ckpt_path: str | None = None  # None: <output_dir>/checkpoints
    num_episodes: int | None = None  # passes over the prompt set; when set, num_steps = episodes x prompts // batch
    num_steps: int = 360
    save_steps: int = 20  # 0 disables periodic checkpoints (a final one is always written)
    max_ckpts_keep: int = 3
    eval_steps: int = 0  # 0 disables periodic eval
    val_before_train: bool = False  # evaluate the base policy before the first update, logged as step 0
    eval_temperature: float = 0.0  # 0: greedy (one sample per prompt suffices)
    eval_n_samples_per_prompt: int = 1  # responses per held-out problem (avg@N pass@1) when eval_temperature > 0
    eval_top_p: float = 1.0
    eval_top_k: int = -1
    resume: str = "auto"  # auto | none | a checkpoint directory
    seed: int = 42
    ray_address: str | None = None  # None: start a local Ray; "auto": join `ray start --head`
    use_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_org: str | None = None
    wandb_group: str | None = None
    wandb_run_name: str | None = None
    tensorboard_dir: str | None = None  # set: TensorBoard on, written there (default <output_dir>/tensorboard)
    export_hf: bool = True
    log_samples: int = 2  # responses printed per step (0: none)
    stop_after_steps: int | None = None  # run at most this many steps in this invocation (tests, time limits)
    verbose: bool = False  # console: also engine/worker output and samples (always in <output_dir>/train.log)
    gpus_per_node: int = 8  # GPU nodes of the cluster (placement keeps TP groups and engines inside one)
    num_nodes: int | None = None  # None: as many as the layout needs (checked against the Ray cluster)


def _train_data() -> DataSection:
    return DataSection(prompt_dataset="bundled:train", input_key="question", label_key="answer",
                       apply_chat_template=True, max_prompt_len=DEFAULT_MAX_PROMPT_LEN)


def _train_engine() -> EngineConfig:
    # model_path / seed / sleep mode / dtype are decided at set-up (from actor.pretrain, trainer.seed, the platform)
    return EngineConfig(kv_cache_gib=2.0, gpu_memory_utilization=0.6, max_model_len=None)


@dataclass
class TrainConfig:
    data: DataSection = field(default_factory=_train_data)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(n=8, max_tokens=8192))
    engine: EngineConfig = field(default_factory=_train_engine)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    actor: ActorSection = field(default_factory=ActorSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)
    ds: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)

    def validate(self, check_paths: bool = True) -> "TrainConfig":
        """Checks that need no model or devices; :func:`validate_against_model` does the rest.

        ``check_paths=False`` (``--dry_run``) skips the checks that local files exist: a dry run
        plans a cluster job on a machine without its data, weights or checkpoints."""
        d, r, a, m, t, sp = self.data, self.rollout, self.actor, self.megatron, self.trainer, self.sampling
        self.shape.validate()
        try:
            d.validate()
        except ValueError as exc:
            raise ValueError(str(exc)) from None

        def need(cond: bool, flag: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"--{public_name(flag)}: {msg}")

        if self.shape.estimator == "grpo" or self.shape.outcome_baseline != "none":
            need(sp.n >= 2, "rollout.n_samples_per_prompt", "GRPO and group baselines need >= 2 samples per prompt")
        need(r.rollout_batch_size >= 1, "rollout.rollout_batch_size", "must be >= 1 prompt per step")
        need(r.num_engines >= 1, "rollout.num_engines", "must be >= 1")
        need(sp.temperature > 0, "rollout.temperature", "must be > 0 (entropy is taken at this temperature)")
        self.rollout_correction().validate()
        if r.is_correction_level != "off":
            need(sp.top_p >= 1 and sp.top_k in (-1, 0), "algo.advantage.is_correction_level",
                 "needs --rollout.top_p 1 and --rollout.top_k -1: under top-p/top-k vLLM's log-probs are of the "
                 "truncated distribution, so every importance weight would carry the truncation mass")
        samples = r.rollout_batch_size * sp.n
        need(a.train_batch_size >= 1, "actor.train_batch_size", "must be >= 1")
        need(
            samples % a.train_batch_size == 0 or r.dynamic_filtering,
            "actor.train_batch_size",
            f"{a.train_batch_size} must divide --rollout.batch_size x --rollout.n_samples_per_prompt = {samples} "
            f"(e.g. --train.batch_size {samples})",
        )
        need(a.max_epochs >= 1, "actor.max_epochs", "must be >= 1")
        need(r.weight_sync_timeout > 0, "rollout.weight_sync_timeout",
             f"{r.weight_sync_timeout}: use a positive number of seconds (the longest one weight sync may take)")
        need(r.max_logprob_gap >= 0, "rollout.max_logprob_gap",
             f"{r.max_logprob_gap}: use 0 (warn past the dtype's expected gap) or a gap in nats past which the run stops")
        need(m.world_size >= 1, "megatron.world_size", "must be >= 1")
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        need(
            m.world_size % mp == 0,
            "megatron.world_size",
            f"{m.world_size} ranks is not a multiple of TP x PP = {mp}; set --actor.num_nodes x "
            "--actor.num_gpus_per_node to TP x PP x DP",
        )
        dp = m.world_size // mp
        need(
            a.train_batch_size % dp == 0,
            "actor.train_batch_size",
            f"{a.train_batch_size} is not divisible by the data-parallel size {dp} (world / (TP x PP))",
        )
        self._validate_backend()
        need(d.max_prompt_len is not None, "data.max_prompt_len", "must be set (tokens; it sizes the engines)")
        need(t.num_steps >= 1, "trainer.num_steps", "must be >= 1")
        need(t.save_steps >= 0 and t.eval_steps >= 0, "trainer.save_steps", "save/eval steps must be >= 0")
        need(t.eval_n_samples_per_prompt >= 1, "trainer.eval_n_samples_per_prompt", "must be >= 1 response per held-out problem")
        need(t.eval_temperature >= 0, "trainer.eval_temperature", "must be >= 0 (0 is greedy)")
        need(0 < t.eval_top_p <= 1, "trainer.eval_top_p", "must lie in (0, 1]")
        need(not ((t.val_before_train or t.eval_steps) and d.eval_max_samples == 0), "data.eval_max_samples",
             "is 0 but an eval is asked for (--eval.steps / --trainer.val_before_train); raise it or use None")
        need(t.max_ckpts_keep >= 1, "trainer.max_ckpts_keep", "must keep at least 1 checkpoint")
        need(not check_paths or t.resume in ("auto", "none") or os.path.isdir(t.resume), "trainer.resume",
             f"{t.resume!r} is neither 'auto', 'none' nor an existing checkpoint directory")
        need(r.weight_sync in ("auto", "collective", "object_store", "cuda_ipc"), "rollout.weight_sync",
             f"{r.weight_sync!r}: use auto, collective, object_store or cuda_ipc")
        need(r.weight_sync != "cuda_ipc" or r.colocate, "rollout.weight_sync",
             "cuda_ipc needs --rollout.colocate (sender and engine worker on the same GPU)")
        need(t.gpus_per_node >= 1, "trainer.gpus_per_node", "must be >= 1")
        self._validate_probes()
        if d.prompt_data.startswith("bundled:"):
            need(d.prompt_data in ("bundled:train", "bundled:test"), "data.prompt_data",
                 "bundled data is 'bundled:train' or 'bundled:test'")
        elif check_paths and not os.path.exists(d.prompt_data) and d.prompt_data.endswith((".jsonl", ".json", ".parquet")):
            raise FileNotFoundError(f"--data.prompt_dataset: file {d.prompt_data} does not exist")
        if check_paths and a.pretrain != "demo" and not os.path.isdir(a.pretrain):
            raise FileNotFoundError(
                f"--actor.model_name_or_path: {a.pretrain} is not a Hugging Face model directory (or use 'demo')"
            )
        return self

    def _validate_backend(self) -> None:
        a, ds = self.actor, self.ds
        if a.backend not in ("megatron", "deepspeed"):
            raise ValueError(f"--actor.backend: {a.backend!r}; use megatron or deepspeed")
        if ds.param_dtype == "fp16":
            raise ValueError("--ds.param_dtype: fp16 needs dynamic loss scaling, which this trainer does not run; "
                             "use bf16 (or fp32 on CPU)")
        if a.backend == "megatron":
            if ds.zero_stage == 3 or ds.adam_offload:
                raise ValueError(
                    "--ds.zero_stage 3 / --ds.adam_offload configure the DeepSpeed backend; add --actor.backend "
                    "deepspeed, or shard on Megatron with --megatron.use_distributed_optimizer")
            return
        from openrlhf_shape.zero.config import zero_config_from

        zero_config_from(self.megatron_config(), ds)  # its errors name the flags

    def rollout_correction(self):
        """``--algo.advantage.is_correction_*`` as a :class:`RolloutCorrectionConfig`."""
        from openrlhf_shape.algorithms.rollout_correction import RolloutCorrectionConfig

        r = self.rollout
        return RolloutCorrectionConfig(r.is_correction_level, r.is_correction_mode, r.is_correction_gating,
                                       tuple(r.is_correction_threshold))

    def _validate_probes(self) -> None:
        p, sh = self.probe, self.shape  # probe: a ProbeConfig
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
        """Engine context in tokens: ``--engine.max_model_len``, else prompt + response + probe room."""
        if self.engine.max_model_len:
            return int(self.engine.max_model_len)
        return int(self.data.max_prompt_len + self.sampling.max_tokens + 64 + self.shape.probe_max_tokens)

    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the LR schedule's length)."""
        per_rollout = max(1, (self.rollout.rollout_batch_size * self.sampling.n) // self.actor.train_batch_size)
        return max(1, self.trainer.num_steps * per_rollout * self.actor.max_epochs)

    def megatron_config(self) -> MegatronConfig:
        """What each Megatron rank gets: ``megatron.*`` with the schedule length and seed filled in."""
        return self.megatron.backend_config(self.total_optimizer_steps(), self.trainer.seed)

    def probe_config(self) -> ProbeConfig:
        """``probe.*`` with m and the probe length from ``--shape.num_probes`` / ``--shape.probe_max_tokens``."""
        return dataclasses.replace(self.probe, num_probes=self.shape.num_probes, max_tokens=self.shape.probe_max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- flags

# Older and foreign flag names -> canonical paths (a tuple: one flag that sets several fields).
# Add rows here to accept more names (e.g. OpenRLHF 0.11 spellings); nothing else changes.
ALIASES: dict[str, Alias] = {
    "algo.advantage.estimator": "shape.estimator",
    "data.prompt_data": "data.prompt_dataset",
    "rollout.n_samples_per_prompt": "sampling.n",
    "rollout.temperature": "sampling.temperature",
    "rollout.top_p": "sampling.top_p",
    "rollout.top_k": "sampling.top_k",
    "rollout.max_new_tokens": "sampling.max_tokens",
    "rollout.generate_max_len": "sampling.max_tokens",
    "rollout.engine_tensor_parallel_size": "engine.tensor_parallel_size",
    "rollout.kv_cache_gib": "engine.kv_cache_gib",
    "rollout.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "rollout.block_size": "engine.block_size",
    "rollout.dtype": "engine.dtype",
    "rollout.max_model_len": "engine.max_model_len",
    "actor.learning_rate": "megatron.lr",
    "actor.lr": "megatron.lr",
    "actor.min_lr": "megatron.min_lr",
    "actor.lr_warmup_ratio": "megatron.lr_warmup_fraction",
    "actor.lr_warmup_steps": "megatron.lr_warmup_steps",
    "actor.lr_decay_style": "megatron.lr_decay_style",
    "actor.weight_decay": "megatron.weight_decay",
    "actor.max_norm": "megatron.clip_grad",
    "actor.eps_clip_low_high": ("megatron.eps_clip_low", "megatron.eps_clip_high"),
    "actor.dual_clip": "megatron.dual_clip",
    "actor.micro_batch_max_tokens": "megatron.micro_batch_max_tokens",
    "actor.micro_train_batch_size_tokens": "megatron.micro_batch_max_tokens",
    "actor.entropy_chunk_size": "megatron.entropy_chunk_size",
    **PUBLIC,  # OpenRLHF 0.11's names and our public names (trainer/flag_translation.py)
}

# Fields computed from other settings at set-up: never flags (the value names the flag to use).
DERIVED: dict[str, str] = {
    "engine.model_path": "--actor.model_name_or_path",
    "engine.seed": "--train.seed",
    "engine.enable_sleep_mode": "--train.colocate_all",
    "megatron.total_steps": "--train.num_steps (with the batch sizes and --train.max_epochs)",
    "megatron.seed": "--train.seed",
    "probe.num_probes": "--shape.num_probes",
    "probe.max_tokens": "--shape.probe_max_tokens",
}

FLAGS = FlagSpace(TrainConfig, ALIASES, DERIVED)


def load_config(yaml_path: str | None = None, overrides: list[str] | None = None, *, check_paths: bool = True) -> TrainConfig:
    """Defaults <- YAML file <- dotted flags; returns a validated :class:`TrainConfig`.

    Flags and YAML keys go through :func:`~openrlhf_shape.trainer.flag_translation.translate` first:
    OpenRLHF flags for parts this trainer does not have are refused (all of them, one line each), old
    names print a deprecation line, OpenRLHF's value encodings are translated. ``check_paths=False``
    (the dry run) skips the checks that the data and model paths exist on this machine."""
    values: dict[str, Any] = {}
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise FileNotFoundError(f"--config: {yaml_path} does not exist (presets live in configs/)")
        with open(yaml_path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config: {yaml_path} must hold a mapping of sections")
        try:
            for flag, value in translate(flatten_mapping(data, FLAGS)):
                values.update(FLAGS.resolve(flag, value))
        except ValueError as exc:
            raise ValueError(f"{yaml_path}: {exc}") from None
    for flag, value in translate(parse_overrides(list(overrides or []))):
        values.update(FLAGS.resolve(flag, value))
    return FLAGS.build(TrainConfig(), values).validate(check_paths=check_paths)
