"""The training job's configuration tree: every flag's name is the attribute path the code reads.

``--train.batch_size 64`` sets ``cfg.train.batch_size``; ``--actor.adam.lr 1e-6`` sets
``cfg.actor.adam.lr``, which both actor backends train with. The sections follow OpenRLHF 0.11
(``data``, ``rollout``, ``vllm``, ``train``, ``actor``, ``algo``, ``eval``, ``ckpt``, ``logger``)
plus ours (``shape``, ``probe``, ``megatron``, ``ds``, ``reward``). A YAML preset uses the same
names nested by dots. Components keep their own config types (:class:`EngineConfig`,
:class:`SamplingConfig`, :class:`MegatronConfig`, ...): the ``*_config()`` methods build them
from the sections, in one place each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional  # noqa: F401 (Optional: the generated sections' field types)

from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.data.prompts import PromptDataConfig
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.rewards.computer import RewardConfig
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.zero.config import ZeroConfig

DEFAULT_MAX_PROMPT_LEN = 1024  # --data.max_prompt_len's default (OpenRLHF's --data.max_len subtracts it)


@dataclass
class RolloutSection:
    """What each step generates: prompts, samples and sampling settings (the engines are ``vllm.*``)."""

    batch_size: int = 128  # prompts per step
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 8192  # response budget in tokens
    temperature: float = 1.0  # entropy and log-probs are taken at this temperature
    top_p: float = 1.0
    top_k: int = -1
    logprobs: bool = False  # engines return the sampled tokens' log-probs (the trainer turns it on when it needs them)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Rollout/trainer log-prob gap (mean |dlogp|, nats) past which the run STOPS; 0 = warn only, past the
    # dtype's expectation (openrlhf_shape/trainer/logprob_guard.py: 5e-5 float32, 5e-2 bf16).
    max_logprob_gap: float = 0.0
    # auto (decided per plan: cluster/placement.py:resolve_weight_sync) | collective (gloo on CPU, NCCL on GPU)
    # | object_store | cuda_ipc
    weight_sync: str = "auto"
    # Seconds any one weight sync (and the sync group's forming) may take, and every wait inside it: past
    # it, or as soon as an engine dies mid-sync, the run stops naming the engine (a hang otherwise).
    weight_sync_timeout: float = 600.0
    num_gpus: int | None = None  # disaggregated engine pool; None: vllm.num_engines x vllm.tensor_parallel_size

    def sampling_config(self) -> SamplingConfig:
        """One generate call's :class:`SamplingConfig` (``n`` samples of ``max_new_tokens``)."""
        return SamplingConfig(n=self.n_samples_per_prompt, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_tokens=self.max_new_tokens, logprobs=self.logprobs,
                              stop=self.stop, stop_token_ids=self.stop_token_ids)


@dataclass
class VllmSection(EngineConfig):
    """The rollout engines: :class:`EngineConfig` (``model_path``, ``seed`` and ``enable_sleep_mode`` are
    decided at set-up) plus how many engines run and how weights reach them."""

    kv_cache_gib: float = 2.0
    gpu_memory_utilization: float = 0.6
    max_model_len: int | None = None  # None: prompt + response + probe room
    num_engines: int = 1
    num_cpus_per_engine: float = 0.5
    weight_sync_bucket_mb: int = 256

    def engine_config(self, **decided: Any) -> EngineConfig:
        """The :class:`EngineConfig` each engine gets, with the set-up's ``decided`` fields."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{**own, **decided})


@dataclass
class TrainSection:
    """The loop: batch sizes, steps, seed, placement."""

    batch_size: int = 256  # samples per optimizer step (mini-batch); the rollout batch is split into these
    max_epochs: int = 1  # passes over each rollout batch
    max_tokens_per_gpu: int = 8192  # prompt + response tokens of one micro-batch on one data-parallel rank
    seed: int = 42
    colocate_all: bool = False  # GPU: vLLM sleeps while the actor trains on the same GPUs
    async_enable: bool = False  # one-step-off: the engines make the next batch while the ranks train (disaggregated only)
    max_staleness: int = 1  # async: updates between the weights that generated a batch and the weights that train on it (1 or 2)
    num_episodes: int | None = None  # passes over the prompt set; when set, num_steps = episodes x prompts // batch
    num_steps: int = 360
    stop_after_steps: int | None = None  # run at most this many steps in this invocation (tests, time limits)
    ray_address: str | None = None  # None: start a local Ray; "auto": join `ray start --head`
    gpus_per_node: int = 8  # GPUs per cluster node (placement keeps TP groups and engines inside one)
    num_nodes: int | None = None  # cluster nodes; None: as many as the layout needs (checked against Ray)


@dataclass
class AdamSection:
    """Adam(W), as both backends run it."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class ActorSection:
    """The policy, its ranks, and the backend-neutral optimiser, schedule and policy-loss settings."""

    model_name_or_path: str = "demo"  # an HF model directory, or "demo" for the bundled SmolLM2-135M-Instruct
    backend: str = "megatron"  # megatron (TP/PP/DP, openrlhf_shape/megatron) | deepspeed (ZeRO DP, openrlhf_shape/zero)
    # ranks = num_nodes x num_gpus_per_node (both unset: 1; one unset: 1 node / 8 GPUs per node, OpenRLHF's defaults)
    num_nodes: int | None = None
    num_gpus_per_node: int | None = None
    num_cpus_per_rank: float = 0.5
    adam: AdamSection = field(default_factory=AdamSection)
    lr_scheduler: str = "constant"  # constant | cosine | linear
    lr_warmup_ratio: float = 0.0  # of the optimizer steps
    lr_warmup_steps: int | None = None  # wins over lr_warmup_ratio
    min_lr: float = 0.0  # absolute
    min_lr_ratio: float | None = None  # min lr = ratio x lr; wins over min_lr
    max_norm: float = 1.0  # gradient clipping (0 off)
    eps_clip_low_high: tuple[float, float] = (0.2, 0.28)  # DAPO clip-higher
    dual_clip: float | None = None
    entropy_chunk_size: int = 1024  # tokens per chunk of the log-prob / entropy computation
    gradient_checkpointing_enable: bool = False  # activation recompute

    @property
    def world_size(self) -> int:
        """Actor ranks (= TP x PP x DP)."""
        if self.num_nodes is None and self.num_gpus_per_node is None:
            return 1
        return (self.num_nodes or 1) * (self.num_gpus_per_node or 8)


@dataclass
class AdvantageSection:
    """``--algo.advantage.*``: the estimator and the rollout/trainer mismatch correction
    (algorithms/rollout_correction.py)."""

    estimator: str = "shape"  # shape | mrt | grpo (OpenRLHF's group_norm)
    is_correction_level: str = "off"  # off | token | seq
    is_correction_mode: str = "mask"  # mask | clip
    is_correction_gating: str = "ratio"  # ratio | binary_kl | tv
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)


@dataclass
class AlgoSection:
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    dynamic_filtering_enable: bool = False  # DAPO: drop prompt groups whose mean score is not strictly inside the range
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)


@dataclass
class EvalSection:
    """Periodic evaluation on held-out prompts (same keys as ``data.*``)."""

    dataset: str | None = None
    split: str = "train"  # split of an HF dataset
    max_samples: int | None = 64
    steps: int = 0  # 0 disables periodic eval
    val_before_train: bool = False  # evaluate the base policy before the first update, logged as step 0
    temperature: float = 0.0  # 0: greedy (one sample per prompt suffices)
    n_samples_per_prompt: int = 1  # responses per held-out problem (avg@N pass@1) when temperature > 0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class CkptSection:
    output_dir: str = "runs/shape"
    path: str | None = None  # None: <output_dir>/checkpoints
    save_steps: int = 20  # 0 disables periodic checkpoints (a final one is always written)
    max_num: int = 3  # checkpoints kept
    save_hf: bool = True  # export the final policy as an HF directory
    resume: str = "auto"  # auto | none | a checkpoint directory


@dataclass
class WandbSection:
    project: str | None = None
    org: str | None = None
    group: str | None = None
    run_name: str | None = None


@dataclass
class LoggerSection:
    use_tensorboard: bool = False
    tensorboard_dir: str | None = None  # set: TensorBoard on, written there (default <output_dir>/tensorboard)
    log_samples: int = 2  # responses printed per step (0: none)
    verbose: bool = False  # console: also engine/worker output and samples (always in <output_dir>/train.log)
    wandb: WandbSection = field(default_factory=WandbSection)


# MegatronConfig fields that are backend-neutral settings of the public tree: rank field -> flag path
# (``[i]``: an element of a pair). The rank-side MegatronConfig and ZeroConfig are built from these;
# every other MegatronConfig field is ``--megatron.<field>`` (the parallel layout and Megatron switches).
RANK_SOURCE: dict[str, str] = {
    "lr": "actor.adam.lr", "adam_beta1": "actor.adam.betas[0]", "adam_beta2": "actor.adam.betas[1]",
    "adam_eps": "actor.adam.eps", "weight_decay": "actor.adam.weight_decay", "lr_decay_style": "actor.lr_scheduler",
    "lr_warmup_fraction": "actor.lr_warmup_ratio", "lr_warmup_steps": "actor.lr_warmup_steps",
    "min_lr": "actor.min_lr", "clip_grad": "actor.max_norm", "eps_clip_low": "actor.eps_clip_low_high[0]",
    "eps_clip_high": "actor.eps_clip_low_high[1]", "dual_clip": "actor.dual_clip",
    "entropy_chunk_size": "actor.entropy_chunk_size", "recompute_activations": "actor.gradient_checkpointing_enable",
    "micro_batch_max_tokens": "train.max_tokens_per_gpu", "seed": "train.seed",
    "total_steps": "train.num_steps (with the batch sizes and --train.max_epochs)",
}


def _section_of(component: type, name: str, skip: set[str], extra: list[tuple]) -> type:
    """A section holding ``component``'s fields minus ``skip`` plus ``extra``: fields a component adds
    (an MoE coefficient in MegatronConfig, say) become flags with no edit here."""
    own = [(f.name, f.type, field(default=f.default) if f.default_factory is dataclasses.MISSING
            else field(default_factory=f.default_factory))
           for f in dataclasses.fields(component) if f.name not in skip and f.name != "extra"]
    cls = dataclasses.make_dataclass(name, own + extra)
    cls.__module__ = __name__  # pickled by reference (Ray); its field types resolve in this module
    return cls


# ``--megatron.*``: the parallel layout and Megatron's own switches, plus the GPUs per rank.
MegatronSection = _section_of(MegatronConfig, "MegatronSection", set(RANK_SOURCE),
                              [("gpus_per_rank", "float", field(default=1.0))])
# ``--ds.*``: what only the DeepSpeed backend has (its training settings are ``actor.*`` / ``train.*``).
DeepSpeedSection = _section_of(ZeroConfig, "DeepSpeedSection", {"train"}, [])


def _train_data() -> PromptDataConfig:
    return PromptDataConfig(prompt_dataset="bundled:train", input_key="question", label_key="answer",
                            apply_chat_template=True, max_prompt_len=DEFAULT_MAX_PROMPT_LEN)


@dataclass
class TrainConfig:
    """The whole job. Validation: :func:`openrlhf_shape.config.checks.validate` (``load_config`` runs it)."""

    data: PromptDataConfig = field(default_factory=_train_data)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    vllm: VllmSection = field(default_factory=VllmSection)
    train: TrainSection = field(default_factory=TrainSection)
    actor: ActorSection = field(default_factory=ActorSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ckpt: CkptSection = field(default_factory=CkptSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    megatron: MegatronSection = field(default_factory=MegatronSection)  # type: ignore[valid-type]
    ds: DeepSpeedSection = field(default_factory=DeepSpeedSection)  # type: ignore[valid-type]
    reward: RewardConfig = field(default_factory=RewardConfig)

    def get(self, path: str) -> Any:
        """The value at a dotted flag path (``actor.adam.betas[1]`` for an element)."""
        path, _, index = path.partition("[")
        node: Any = self
        for part in path.split("."):
            node = getattr(node, part)
        return node[int(index[:-1])] if index else node

    def max_model_len(self) -> int:
        """Engine context in tokens: ``--vllm.max_model_len``, else prompt + response + probe room."""
        if self.vllm.max_model_len:
            return int(self.vllm.max_model_len)
        return int(self.data.max_prompt_len + self.rollout.max_new_tokens + 64 + self.probe.max_tokens)

    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the LR schedule's length)."""
        per_rollout = max(1, (self.rollout.batch_size * self.rollout.n_samples_per_prompt) // self.train.batch_size)
        return max(1, self.train.num_steps * per_rollout * self.train.max_epochs)

    @staticmethod
    def megatron_flag(name: str) -> str:
        """The flag (without ``--``) that sets MegatronConfig field ``name``: ``actor.*`` / ``train.*`` for the
        backend-neutral settings (:data:`RANK_SOURCE`), ``megatron.<name>`` for the rest."""
        return RANK_SOURCE[name].split("[")[0] if name in RANK_SOURCE else f"megatron.{name}"

    def megatron_config(self) -> MegatronConfig:
        """What each actor rank gets: ``megatron.*`` plus the backend-neutral ``actor.*`` / ``train.*``
        settings (:data:`RANK_SOURCE`), the schedule length and the seed."""
        own = {f.name: getattr(self.megatron, f.name) for f in dataclasses.fields(MegatronConfig)
               if f.name not in RANK_SOURCE and f.name != "extra"}
        neutral = {name: self.get(path) for name, path in RANK_SOURCE.items() if name != "total_steps"}
        if self.actor.min_lr_ratio is not None:
            neutral["min_lr"] = self.actor.min_lr_ratio * self.actor.adam.lr
        return MegatronConfig(**own, **neutral, total_steps=self.total_optimizer_steps())

    def zero_config(self) -> ZeroConfig:
        """What each DeepSpeed rank gets: ``ds.*`` plus the same training settings as Megatron's."""
        from openrlhf_shape.zero.config import zero_config_from

        return zero_config_from(self.megatron_config(), self.ds)

    def rollout_correction(self):
        """``--algo.advantage.is_correction_*`` as a :class:`RolloutCorrectionConfig`."""
        from openrlhf_shape.algorithms.rollout_correction import RolloutCorrectionConfig

        a = self.algo.advantage
        return RolloutCorrectionConfig(a.is_correction_level, a.is_correction_mode, a.is_correction_gating,
                                       tuple(a.is_correction_threshold))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
