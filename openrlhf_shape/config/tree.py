"""The training job's configuration tree: every flag's name is the attribute path the code reads.

``--train.batch_size 64`` sets ``cfg.train.batch_size``; ``--actor.adam.lr 1e-6`` sets
``cfg.actor.adam.lr``, which both actor backends train with. The sections follow OpenRLHF 0.11
(``data``, ``rollout``, ``vllm``, ``train``, ``actor``, ``ref``, ``critic``, ``algo``, ``eval``, ``ckpt``, ``logger``)
plus ours (``shape``, ``probe``, ``megatron``, ``ds``, ``reward``). A YAML preset uses the same
names nested by dots. Components keep their own config types (:class:`EngineConfig`,
:class:`SamplingConfig`, :class:`OptimConfig`, :class:`MegatronConfig`, ...); a section that feeds one
extends the component's settings class, so its fields are the component's, by name. The
``*_config()`` methods build the components from the sections, in one place each. ``--actor.backend`` names a
backend record (:mod:`openrlhf_shape.actor.backends`), each registered by its package's ``backend.py``, imported
here beside its flag section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from openrlhf_shape.actor.backends import Backend, backend_named
from openrlhf_shape.actor.optim import AdamConfig, OptimConfig, OptimSettings
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.algorithms.kl import KLController, KLPenalty
from openrlhf_shape.algorithms.length_penalty import RewardShaping
from openrlhf_shape.data.prompts import PromptDataConfig
from openrlhf_shape.megatron.backend import MEGATRON  # noqa: F401  (registers --actor.backend megatron)
from openrlhf_shape.megatron.config import MegatronConfig, MegatronSettings
from openrlhf_shape.rewards.computer import RewardConfig
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig
from openrlhf_shape.zero.backend import DEEPSPEED  # noqa: F401  (registers --actor.backend deepspeed)
from openrlhf_shape.zero.config import ZeroConfig, ZeroSettings

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
    # auto (decided per plan by the transports' own constraints: weight_sync.choose_transport) or the name of a
    # registered transport (weight_sync.TRANSPORTS)
    weight_sync: str = "auto"
    # Seconds a weight sync may go without a bucket completing on any side (the sync's progress bound, not
    # its total: a slow sync that keeps completing buckets runs as long as it needs; also the longest the sync
    # group's forming may take). Past it, or as soon as an engine dies mid-sync, the run stops naming who holds
    # the sync up, the bucket and the step (a hang otherwise). openrlhf_shape/weight_sync/README.md
    weight_sync_timeout: float = 600.0
    # Engine actors the run may replace when one dies or stalls (--rollout.engine_stall_timeout) during generation,
    # probes, eval or a weight sync (rollout/group.py, EngineGroup.recover): a new one on the same bundle, its share of
    # the call sent again with the same request seeds (a sync: the group re-formed and the sync done again). 0
    # (default): a lost engine stops the run, as before. After a sync the replacement gets the ranks' weights
    # (synchronous schedule); the asynchronous schedules' ranks are ahead, so there the other engines take its share
    # and it joins at the next sync (with a single engine the run stops).
    max_engine_restarts: int = 0
    # With --rollout.max_engine_restarts > 0: keep one spare engine process that has paid its imports (torch, vLLM;
    # most of an engine's start on CPU), so a replacement costs the engine's build, not a process start
    # (rollout/standby.py). It holds no CPU or GPU share and ~0.6 GiB of host memory; false: replacements start cold.
    engine_standby: bool = True
    # Seconds an engine may go without one step of its engine loop during a call (generation, probes, eval, the
    # fidelity scores) before it counts as dead: killed and, within --rollout.max_engine_restarts, replaced with its
    # share sent again (rollout/watch.py); 0: not watched (a hung engine hangs the run). 300: a step is one forward
    # of the running batch, milliseconds to seconds (a whole long prefill on CPU, tens of seconds), so five minutes
    # without one is a hang (a stopped process, a collective or driver fault), not slowness. Engine start (a GPU
    # engine compiles for minutes) is not a call and is not bounded by this.
    engine_stall_timeout: float = 300.0
    num_gpus: int | None = None  # disaggregated engine pool; None: vllm.num_engines x vllm.tensor_parallel_size
    # prompt + response tokens of one forward-only micro-batch (old log-probs, entropy) on one data-parallel rank;
    # None: --train.max_tokens_per_gpu (OpenRLHF's rule). No gradients or optimizer in flight: it may be larger.
    max_tokens_per_gpu: int | None = None
    # --train.partial_rollout_enable: the most new tokens a response gains per engine round before it is cut and
    # re-submitted with its prefix (weights change only between rounds); None: a quarter of --rollout.max_new_tokens.
    # A window runs rounds until a batch of prompt groups is finished; in steady state one round: the per-step cap.
    partial_chunk_tokens: int | None = None

    def partial_chunk(self) -> int:
        """``--rollout.partial_chunk_tokens``, or its default: a quarter of ``max_new_tokens`` (at least 1)."""
        return self.partial_chunk_tokens if self.partial_chunk_tokens is not None else max(1, self.max_new_tokens // 4)

    def sampling_config(self) -> SamplingConfig:
        """The rollout's :class:`SamplingConfig` (``n`` samples of ``max_new_tokens``). Untruncated sampling (top-p 1,
        no top-k) also returns the sampled tokens' log-probs: every step logs the rollout/trainer mismatch from them
        (and the correction weighs by them); under top-p/top-k they are of another distribution."""
        untruncated = self.top_p >= 1.0 and self.top_k in (-1, 0)
        return SamplingConfig(n=self.n_samples_per_prompt, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_tokens=self.max_new_tokens, logprobs=self.logprobs or untruncated,
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
    max_tokens_per_gpu: int = 16192  # prompt + response tokens of one micro-batch on one data-parallel rank
    seed: int = 42
    colocate_all: bool = False  # GPU: vLLM sleeps while the actor trains on the same GPUs
    colocate_critic_reward: bool = False  # the critic and the reward model share GPUs (OpenRLHF's flag)
    async_enable: bool = False  # one-step-off: the engines make the next batch while the ranks train (disaggregated only)
    max_staleness: int = 1  # async: updates between the weights that generated a batch and the weights that train on it (1 or 2)
    # async: responses still running at a weight sync continue under the new weights, each token's version recorded
    # (OpenRLHF's flag; cut every --rollout.partial_chunk_tokens: rollout/partial.py)
    partial_rollout_enable: bool = False
    num_episodes: int | None = None  # passes over the prompt set; when set, num_steps = episodes x prompts // batch
    num_steps: int = 360
    stop_after_steps: int | None = None  # run at most this many steps in this invocation (tests, time limits)
    # Times the run may restart its rank groups when an actor or reference rank dies (trainer/ppo_trainer.py): same
    # bundles, resumed from the newest complete checkpoint, the engines kept and re-synced. 0: a dead rank stops the run.
    max_restarts: int = 0
    ray_address: str | None = None  # None: start a local Ray; "auto": join `ray start --head`
    gpus_per_node: int = 8  # GPUs per cluster node (placement keeps TP groups and engines inside one)
    num_nodes: int | None = None  # cluster nodes; None: as many as the layout needs (checked against Ray)
    # An OpenRLHF agent file (AgentExecutor over AgentInstanceBase): the samples are its episodes (rollout/agents.py)
    agent_func_path: str | None = None


@dataclass
class ActorSection(OptimSettings):
    """The policy and its ranks, plus :class:`OptimSettings`: the backend-neutral optimiser (``adam.*``),
    schedule, clipping and policy-loss settings both backends train with (validated when set)."""

    model_name_or_path: str = "demo"  # an HF model directory, or "demo" for the bundled SmolLM2-135M-Instruct
    backend: str = "megatron"  # a registered backend's name (actor/backends.py; the README's table)
    # ranks = num_nodes x num_gpus_per_node (both unset: 1; one unset: 1 node / 8 GPUs per node, OpenRLHF's defaults)
    num_nodes: int | None = None
    num_gpus_per_node: int | None = None
    num_cpus_per_rank: float = 0.5

    @property
    def world_size(self) -> int:
        """Actor ranks (= TP x PP x DP)."""
        if self.num_nodes is None and self.num_gpus_per_node is None:
            return 1
        return (self.num_nodes or 1) * (self.num_gpus_per_node or 8)


@dataclass
class SideRanks:
    """The rank count of a model beside the actor (the reference, the critic): ranks = num_nodes x
    num_gpus_per_node (both unset: as many as the actor's; one unset: 1 node / 8 GPUs per node)."""

    num_nodes: int | None = None
    num_gpus_per_node: int | None = None

    def world_size(self, actor_world: int) -> int:
        """Its ranks; ``actor_world`` when neither flag is given."""
        if self.num_nodes is None and self.num_gpus_per_node is None:
            return actor_world
        return (self.num_nodes or 1) * (self.num_gpus_per_node or 8)


@dataclass
class RefSection(SideRanks):
    """``--ref.*``: the reference model's ranks, started only when ``--algo.kl.init_coef`` > 0 (the initial
    weights, forward only, the actor's backend and TP/PP/EP layout). Under ``--train.colocate_all`` they share the
    actor's GPUs (so they must be as many: OpenRLHF's rule); otherwise they get their own."""

    # its parameters in host memory except during its own forward, colocated or not (OpenRLHF's --ref.offload)
    offload: bool = False


_CRITIC_OPTIM = ("adam", "lr_scheduler", "lr_warmup_ratio", "lr_warmup_steps", "min_lr", "min_lr_ratio", "max_norm")


@dataclass
class CriticSection(SideRanks):
    """``--critic.*``: the value model that ``--algo.advantage.estimator gae`` reads, with OpenRLHF 0.11.2's defaults:
    its ranks (both unset: as many as the actor's), where it starts from, its loss's clip, its own optimiser and
    schedule (the fields and meanings of ``--actor.*``'s, :class:`OptimSettings`), the actor's frozen first steps."""

    model_name_or_path: str | None = None  # unset: the actor's (OpenRLHF: a reward model's when given, else the actor's)
    value_clip: float = 0.5  # the value may move this far from its old value before its gradient is held (ValueLoss)
    freezing_steps: int = -1  # as OpenRLHF 0.11.2: N >= 0 freezes the actor for the first N + 1 steps; -1: never
    save_value_network: bool = False  # also save the critic's final weights (HF format) with the run
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=9e-6))
    lr_scheduler: str = "cosine_with_min_lr"
    lr_warmup_ratio: float = 0.03
    lr_warmup_steps: int | None = None  # ours, as --actor.lr_warmup_steps
    min_lr: float | None = None  # ours, as --actor.min_lr
    min_lr_ratio: float | None = 0.1
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        if not self.value_clip >= 0:
            raise ValueError(f"CriticSection.value_clip must be >= 0 (OpenRLHF's 0.5 by default), got {self.value_clip}")
        if self.freezing_steps < -1:
            raise ValueError(f"CriticSection.freezing_steps must be >= -1 (-1: the actor is never frozen), got "
                             f"{self.freezing_steps}")
        self.optim_settings()

    def optim_settings(self) -> OptimSettings:
        """The critic's optimiser and schedule as the backends take them (the policy-loss fields are unused)."""
        try:
            return OptimSettings(**{k: getattr(self, k) for k in _CRITIC_OPTIM})
        except ValueError as exc:  # worded for --critic.*, not --actor.*
            raise ValueError(str(exc).replace("OptimSettings.", "CriticSection.")) from None


@dataclass
class KLSection:
    """``--algo.kl.*``: the KL penalty to the reference model (openrlhf_shape/algorithms/kl.py)."""

    init_coef: float = 0.0  # 0: no reference model, no KL (the paper's setting; OpenRLHF's default is 0.01)
    use_loss: bool = False  # KL in the policy loss; off: -coef * kl per token in the reward (OpenRLHF's default)
    estimator: str = "k1"  # k1 | k2 | k3
    target: float | None = None  # set: the adaptive controller aims the step's kl at this value
    horizon: int = 10000  # samples over which the adaptive controller closes its error
    unbiased_gradient: bool = False  # KL in the loss: the reverse-KL gradient, importance-weighted from the old policy

    @property
    def enabled(self) -> bool:
        """A reference model runs (and KL is computed) only with a positive coefficient."""
        return self.init_coef > 0


@dataclass
class AdvantageSection:
    """``--algo.advantage.*``: the estimator and the rollout/trainer mismatch correction
    (algorithms/rollout_correction.py)."""

    # a registered name (algorithms/estimators.py:ESTIMATOR_REGISTRY) or OpenRLHF's alias of one
    # (config/openrlhf.py:ESTIMATOR_ALIASES)
    estimator: str = "shape"
    gamma: float = 1.0  # the return's per-token discount (estimators that discount returns; OpenRLHF's flag)
    no_std_norm: bool = False  # whitening without the std division (estimators that whiten)
    lambd: float = 1.0  # GAE's lambda (estimators with a critic: gae)
    is_correction_level: str = "off"  # off | token | seq
    is_correction_mode: str = "mask"  # mask | clip
    is_correction_gating: str = "ratio"  # ratio | binary_kl | tv
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)


@dataclass
class AlgoSection:
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    kl: KLSection = field(default_factory=KLSection)
    # DAPO: drop prompt groups whose mean score is not strictly inside the range and sample new prompts in their place
    # until --rollout.batch_size groups passed (OpenRLHF's refill; trainer/experience.py, ShapeExperienceMaker.fill)
    dynamic_filtering_enable: bool = False
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    # Ours: the most refill rounds of one step (each asks for the groups still missing); past it the run stops, naming
    # this flag. At pass rate p a batch of G groups needs about ln(G) / -ln(1 - p) rounds: ~10 for G 128 at p 0.4.
    dynamic_filtering_max_rounds: int = 32


@dataclass
class EvalSection:
    """Periodic evaluation on held-out prompts (same keys as ``data.*``)."""

    dataset: str | None = None
    split: str = "train"  # split of an HF dataset
    max_samples: int | None = 64
    steps: int = 0  # 0 disables periodic eval
    val_before_train: bool = False  # evaluate the base policy before the first update, logged as step 0
    temperature: float = 0.6  # 0: greedy (one sample per prompt suffices)
    n_samples_per_prompt: int = 4  # responses per held-out problem (avg@N pass@1)
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


@dataclass
class MegatronSection(MegatronSettings):
    """``--megatron.*``: the parallel layout and Megatron's own switches, plus the GPUs per rank."""

    gpus_per_rank: float = 1.0


@dataclass
class TrainConfig:
    """The whole job. Validation: :func:`openrlhf_shape.config.checks.validate` (``load_config`` runs it)."""

    data: PromptDataConfig = field(default_factory=lambda: PromptDataConfig(
        prompt_dataset="bundled:train", input_key="question", label_key="answer", apply_chat_template=True,
        max_prompt_len=DEFAULT_MAX_PROMPT_LEN, max_samples=100_000_000))
    rollout: RolloutSection = field(default_factory=RolloutSection)
    vllm: VllmSection = field(default_factory=VllmSection)
    train: TrainSection = field(default_factory=TrainSection)
    actor: ActorSection = field(default_factory=ActorSection)
    ref: RefSection = field(default_factory=RefSection)
    critic: CriticSection = field(default_factory=CriticSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ckpt: CkptSection = field(default_factory=CkptSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    megatron: MegatronSection = field(default_factory=MegatronSection)
    ds: ZeroSettings = field(default_factory=ZeroSettings)  # --ds.*: what only the DeepSpeed backend has
    reward: RewardConfig = field(default_factory=RewardConfig)

    def get(self, path: str) -> Any:
        """The value at a dotted flag path (``actor.adam.betas[1]`` for an element)."""
        path, _, index = path.partition("[")
        node: Any = self
        for part in path.split("."):
            node = getattr(node, part)
        return node[int(index[:-1])] if index else node

    def partial_chunk_in_effect(self) -> int:
        """Tokens per round of a partial rollout (``--rollout.partial_chunk_tokens``) when responses are cut: under
        ``--train.partial_rollout_enable`` without an agent (an agent's episodes run whole); else 0 (no cut)."""
        if not self.train.partial_rollout_enable or self.train.agent_func_path:
            return 0
        return self.rollout.partial_chunk()

    def max_model_len(self) -> int:
        """Engine context in tokens: ``--vllm.max_model_len``, else prompt + response + probe room."""
        if self.vllm.max_model_len:
            return int(self.vllm.max_model_len)
        return int(self.data.max_prompt_len + self.rollout.max_new_tokens + 64 + self.probe.max_tokens)

    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the LR schedule's length), exactly the updates it takes: every step
        trains ``rollout.batch_size x n_samples_per_prompt`` samples (dynamic filtering refills the groups it drops)
        in ``samples // train.batch_size`` mini-batches per pass, the rest dropped (OpenRLHF's ``drop_last``)."""
        per_rollout = max(1, (self.rollout.batch_size * self.rollout.n_samples_per_prompt) // self.train.batch_size)
        return max(1, self.train.num_steps * per_rollout * self.train.max_epochs)

    def optim_config(self) -> OptimConfig:
        """What both backends train with: the ``actor.*`` settings (same names) plus what the run decides:
        the schedule's length, ``--train.max_tokens_per_gpu``, ``--rollout.max_tokens_per_gpu`` and ``--train.seed``."""
        own = {f.name: getattr(self.actor, f.name) for f in dataclasses.fields(OptimSettings)}
        return OptimConfig(**own, total_steps=self.total_optimizer_steps(),
                           micro_batch_max_tokens=self.train.max_tokens_per_gpu,
                           forward_max_tokens=self.rollout.max_tokens_per_gpu, seed=self.train.seed)

    def critic_optim_config(self) -> OptimConfig:
        """What the critic's ranks train with: ``critic.*``'s optimiser and schedule, over the actor's run length
        (OpenRLHF builds both schedules from one max_steps) and micro-batch budgets."""
        actor = self.optim_config()
        return dataclasses.replace(actor, **{k: getattr(self.critic, k) for k in _CRITIC_OPTIM})

    def critic_model_path(self) -> str:
        """Where the critic starts: ``--critic.model_name_or_path``, else the reward model's
        (``--reward.model_name_or_path``), else the actor's (OpenRLHF 0.11.2's rule in ``train_ppo_ray``: the reward
        model's when one is given, the actor's with a remote reward)."""
        return self.critic.model_name_or_path or self.reward.model_name_or_path or self.actor.model_name_or_path

    def backend(self) -> Backend:
        """The record of ``--actor.backend`` (its worker, rank config, model checks, trainer dtype)."""
        return backend_named(self.actor.backend)

    def megatron_config(self) -> MegatronConfig:
        """What each Megatron rank gets: ``megatron.*`` (same names), :meth:`optim_config` and the value head's name
        (``--ds.value_head_prefix``)."""
        own = {f.name: getattr(self.megatron, f.name) for f in dataclasses.fields(MegatronSettings)}
        return MegatronConfig(**own, optim=self.optim_config(), value_head_prefix=self.ds.value_head_prefix)

    def zero_config(self) -> ZeroConfig:
        """What each DeepSpeed rank gets: ``ds.*`` (same names) and :meth:`optim_config`."""
        own = {f.name: getattr(self.ds, f.name) for f in dataclasses.fields(ZeroSettings)}
        return ZeroConfig(**own, optim=self.optim_config())

    def advantage_estimator(self):
        """``--algo.advantage.estimator`` bound to ``--shape.*`` and ``--algo.advantage.gamma`` / ``no_std_norm`` /
        ``lambd`` (:func:`~openrlhf_shape.algorithms.estimators.get_estimator`; raises on settings it cannot honour)."""
        from openrlhf_shape.algorithms import ReturnConfig, get_estimator

        a = self.algo.advantage
        return get_estimator(a.estimator, self.shape, ReturnConfig(a.gamma, a.no_std_norm, a.lambd))

    def rollout_correction(self):
        """``--algo.advantage.is_correction_*`` as a :class:`RolloutCorrectionConfig`."""
        from openrlhf_shape.algorithms.rollout_correction import RolloutCorrectionConfig

        a = self.algo.advantage
        return RolloutCorrectionConfig(a.is_correction_level, a.is_correction_mode, a.is_correction_gating,
                                       tuple(a.is_correction_threshold))

    def kl_penalty(self) -> KLPenalty:
        """The KL settings (``--algo.kl.*``); whether a reference model runs at all is ``algo.kl.enabled``."""
        k = self.algo.kl
        return KLPenalty(k.estimator, bool(k.use_loss), bool(k.unbiased_gradient))

    def kl_controller(self) -> KLController:
        """A fresh KL coefficient controller (``--algo.kl.init_coef``; adaptive with ``--algo.kl.target``)."""
        k = self.algo.kl
        return KLController(float(k.init_coef), None if k.target is None else float(k.target), int(k.horizon))

    def reward_shaping(self) -> RewardShaping:
        """The rewards phase's switches: ``--algo.dynamic_filtering_*``, ``--reward.clip_range`` and
        ``--reward.stop_properly_penalty_coef``."""
        a, r = self.algo, self.reward
        return RewardShaping(a.dynamic_filtering_enable, a.dynamic_filtering_range, a.dynamic_filtering_max_rounds,
                             r.clip_range, r.stop_properly_penalty_coef)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
