"""Set-up of a training run, apart from the loop: data, Ray, engines, the actor group, rewards.

:func:`build_run` turns a :class:`~openrlhf_shape.config.TrainConfig` into a :class:`Run`
holding every component the loop (:mod:`openrlhf_shape.trainer.ppo_trainer`) drives.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from openrlhf_shape.platform import Platform, detect_platform
from openrlhf_shape.config import TrainConfig
from openrlhf_shape.config.checks import check_dtypes
from openrlhf_shape.trainer.logging_utils import log

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from openrlhf_shape.algorithms.kl import KLPenalty
    from openrlhf_shape.cluster.runtime import ClusterRuntime
    from openrlhf_shape.data.prompts import PromptBatcher
    from openrlhf_shape.rewards.computer import RewardComputer
    from openrlhf_shape.trainer.logprob_guard import LogprobGapGuard
    from openrlhf_shape.trainer.schedule import SyncSchedule

@dataclass
class Run:
    """The components of one training run (built by :func:`build_run`); the cluster side (ranks, engines,
    weight sync, colocation lifecycle) is ``cluster``."""

    model_dir: str
    platform: Platform  # the run's CPU/GPU profile (openrlhf_shape/platform.py)
    tokenizer: Any  # the policy's Hugging Face tokenizer
    batcher: PromptBatcher  # over the training prompts
    eval_items: list | None  # held-out prompt items
    cluster: ClusterRuntime  # rank group, engines, weight sync, lifecycle (openrlhf_shape/cluster/runtime.py)
    reward: RewardComputer
    kl: KLPenalty | None  # the KL settings with a reference model (--algo.kl.init_coef > 0); the trainer owns the coef
    schedule: SyncSchedule  # the experience maker's phases, and when they run relative to the update (--train.async_enable)
    gap_guard: LogprobGapGuard  # is the engine running the trained policy (every step)
    own_ray: bool
    setup_seconds: float


def resolve_model_dir(pretrain: str) -> str:
    if pretrain == "demo":
        from openrlhf_shape.data.demo_model import ensure_demo_model

        return ensure_demo_model()
    return pretrain


def _prompt_source(spec: str) -> str:
    if spec.startswith("bundled:"):
        from openrlhf_shape.data.prompts import bundled_math_path

        return bundled_math_path(spec.split(":", 1)[1])
    return spec


def build_data(cfg: TrainConfig, tokenizer) -> tuple[Any, list | None]:
    """The training prompt batcher and the held-out prompt items (None without ``--eval.dataset``).
    With ``--train.num_episodes`` it sets ``trainer.num_steps`` from the number of usable prompts."""
    from openrlhf_shape.data.prompts import PromptBatcher, build_prompt_dataset

    prompts = cfg.data  # a PromptDataConfig (plus the held-out fields)
    dataset = build_prompt_dataset(dataclasses.replace(prompts, prompt_dataset=_prompt_source(prompts.prompt_dataset)),
                                   tokenizer)
    if len(dataset) < cfg.rollout.batch_size:
        raise ValueError(
            f"--rollout.batch_size {cfg.rollout.batch_size} exceeds the {len(dataset)} "
            f"usable prompts of {cfg.data.prompt_dataset} ({dataset.num_filtered} filtered by "
            f"--data.max_prompt_len {cfg.data.max_prompt_len})"
        )
    log.info("prompts: %d usable, %d filtered as longer than %d tokens", len(dataset), dataset.num_filtered,
             cfg.data.max_prompt_len)
    if cfg.train.num_episodes:  # OpenRLHF's --train.num_episodes: passes over the prompt set
        cfg.train.num_steps = max(1, cfg.train.num_episodes * (len(dataset) // cfg.rollout.batch_size))
        log.info("--train.num_episodes %d: %d steps", cfg.train.num_episodes, cfg.train.num_steps)
    batcher = PromptBatcher(dataset, cfg.rollout.batch_size, seed=cfg.train.seed)
    samples, mb = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt, cfg.train.batch_size
    if samples % mb:
        log.warning("--train.batch_size %d does not divide the %d samples of a step: each pass over a step's batch "
                    "trains %d mini-batches and drops %d sample(s) (OpenRLHF's drop_last)", mb, samples, samples // mb,
                    samples % mb)
    eval_items = None
    if cfg.eval.dataset:
        held_out = dataclasses.replace(prompts, prompt_dataset=_prompt_source(cfg.eval.dataset),
                                       max_samples=cfg.eval.max_samples, prompt_split=cfg.eval.split)
        eval_items = list(build_prompt_dataset(held_out, tokenizer))
    return batcher, eval_items


def start_ray(cfg: TrainConfig) -> bool:
    """Join ``--train.ray_address`` or start a local Ray; True when this run started (and so owns) the
    Ray instance. A Ray that is already up (a test, a notebook) is used and left running."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.train.ray_address:
        ray.init(address=cfg.train.ray_address, log_to_driver=True)
        return False
    # Workers' import-time notices are not silenced: they go to <output_dir>/train.log (trainer/console.py).
    ray.init(address="local", include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    return True


def build_agent(cfg: TrainConfig, tokenizer):
    """The agent runner of ``--train.agent_func_path`` (None without one): episodes of up to
    ``--data.max_prompt_len`` + ``--rollout.max_new_tokens`` tokens, OpenRLHF's ``--data.max_len``."""
    if not cfg.train.agent_func_path:
        return None
    from openrlhf_shape.rollout.agents import AgentRunner

    runner = AgentRunner(cfg.train.agent_func_path, tokenizer, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    log.info("agent: %s (episodes of up to %d tokens; the environment's replies get no loss and no credit)%s",
             cfg.train.agent_func_path, runner.max_length,
             "; held-out eval stays single-turn (Math-Verify on one generation)" if cfg.eval.dataset else "")
    return runner


def build_run(cfg: TrainConfig) -> Run:
    """Build every component; the engines and the Megatron ranks start concurrently."""
    from transformers import AutoConfig, AutoTokenizer

    from openrlhf_shape.rewards.computer import RewardComputer
    from openrlhf_shape.cluster.runtime import connect_sync, start_cluster
    from openrlhf_shape.trainer.logprob_guard import guard_for_run

    t0 = time.perf_counter()
    model_dir = resolve_model_dir(cfg.actor.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batcher, eval_items = build_data(cfg, tokenizer)  # may set num_steps (--train.num_episodes): the LR's length
    backend = cfg.backend()
    model_config = AutoConfig.from_pretrained(model_dir)
    backend.check_model(cfg, model_config, model_dir)  # a model the backend and layout cannot train: refused now

    own_ray = start_ray(cfg)
    platform = detect_platform(cfg)  # THE CPU/GPU decision of the run, handed to every rank and engine
    check_dtypes(cfg, platform)  # bf16 on a CPU run: refused (Megatron) or said once (DeepSpeed)
    log.info("platform: %s (%s, %g GPUs seen), %s in %s over %s, layer spec %s, vLLM dtype %s", platform.device,
             platform.source, platform.cluster_gpus, backend.name, backend.trainer_dtype(cfg, platform),
             platform.collective_backend, platform.layer_spec, platform.engine_dtype)
    engine_cfg = cfg.vllm.engine_config(
        model_path=model_dir, seed=cfg.train.seed, max_model_len=cfg.max_model_len(),
        enable_sleep_mode=bool(platform.engine_sleep_mode and cfg.train.colocate_all),
        dtype=platform.engine_dtype if cfg.vllm.dtype == "auto" else cfg.vllm.dtype,
        return_routed_experts=cfg.megatron.routing_replay == "r3",  # R3: the engines return each token's experts
        sampled_entropy=cfg.shape.entropy_source == "engine",  # the engines' samplers record token entropies
    )
    replica = backend.rank_config(cfg).ranks_per_replica
    log.info("starting %d vLLM engine(s) and %d %s rank(s) (%d per data-parallel replica, DP %d)%s",
             cfg.vllm.num_engines, cfg.actor.world_size, backend.name, replica, cfg.actor.world_size // replica,
             f" and {cfg.ref.world_size(cfg.actor.world_size)} reference rank(s)" if cfg.algo.kl.enabled else "")
    # Placement plan -> placement groups -> ranks and engines on their bundles (openrlhf_shape/cluster).
    cluster = start_cluster(cfg, engine_cfg, platform)
    log.info("actor: %s", cluster.ranks.init_model(model_dir))
    if cluster.refs is not None:  # --algo.kl.init_coef > 0: the initial weights, forward only
        log.info("reference model (%d ranks): %s", cluster.refs.world_size, cluster.refs.init_reference(model_dir))
    if cluster.critics is not None:  # gae: the critic from --critic.model_name_or_path (TrainConfig.critic_model_path)
        info = cluster.critics.init_critic(resolve_model_dir(cfg.critic_model_path()), cfg.critic_optim_config(),
                                           cfg.critic.value_clip, cfg.train.seed)
        log.info("critic (%d ranks): %s", cluster.critics.world_size, info)
    connect_sync(cluster)  # the trainer's engine group owns the sync (rank 0 sends)
    reward = RewardComputer(cfg.reward)
    if cluster.rms is not None:  # --reward.model_name_or_path: answers (and probes) scored by its ranks
        attach_reward_model(cfg, cluster, reward)
    kl = cfg.kl_penalty() if cluster.refs is not None else None
    schedule = build_schedule(cfg, cluster, batcher, tokenizer, reward, kl)
    gap_guard = guard_for_run(cfg, platform, model_config, engine_cfg.dtype)
    seconds = time.perf_counter() - t0
    log.info("set-up done in %.1f s", seconds)
    return Run(model_dir=model_dir, platform=platform, tokenizer=tokenizer, batcher=batcher, eval_items=eval_items,
               cluster=cluster, reward=reward, kl=kl, schedule=schedule, gap_guard=gap_guard,
               own_ray=own_ray, setup_seconds=seconds)


def attach_reward_model(cfg: TrainConfig, cluster: ClusterRuntime, reward: RewardComputer) -> None:
    """Build the reward model on its ranks and bind it to ``reward``: a sequence's score is its last token's value
    (OpenRLHF's reward model: eos included as sampled), normalised by config.json's mean/std under
    ``--reward.normalize_enable``; SHAPE/MRT map it through a sigmoid so that R and the potentials lie in [0, 1]."""
    from transformers import AutoConfig

    from openrlhf_shape.actor.value_model import (ValueHeadFormat, read_checkpoint_tensor, sequence_rewards,
                                                  value_head_format)
    from openrlhf_shape.batch import SequenceBatch

    rm_dir = resolve_model_dir(cfg.reward.model_name_or_path)
    prefix = value_head_format(AutoConfig.from_pretrained(rm_dir), cfg.ds.value_head_prefix).prefix
    if read_checkpoint_tensor(rm_dir, f"{prefix}.weight") is None:  # a causal LM: OpenRLHF's loader draws the head
        log.warning("--reward.model_name_or_path %s has no value head '%s.weight': a head is drawn from --train.seed "
                    "(scores are then arbitrary; give a trained reward model)", rm_dir, prefix)
    info = cluster.rms.init_value_model(rm_dir, head_seed=cfg.train.seed)
    log.info("reward model (%d ranks): %s", cluster.rms.world_size, info)
    fmt, normalize = ValueHeadFormat(info["value_head_prefix"], info["mean"], info["std"]), cfg.reward.normalize_enable

    def scores(sequences: list[list[int]]) -> torch.Tensor:
        # prompt = the whole sequence: one state per sample, its last token's (the reward model's score)
        batch = SequenceBatch(sequences=sequences, prompt_lens=[len(s) for s in sequences], temperature=1.0)
        return sequence_rewards(cluster.lifecycle.reward_values(batch), fmt, normalize)

    squash = cfg.advantage_estimator().needs_segments
    if squash:
        log.info("reward model with --algo.advantage.estimator %s: each score%s goes through a sigmoid, so that R "
                 "and the probe potentials lie in [0, 1] as SHAPE/MRT need", cfg.algo.advantage.estimator,
                 " (normalised first)" if normalize else "")
    reward.attach_model(scores, squash)


def build_schedule(cfg: TrainConfig, cluster: ClusterRuntime, batcher: PromptBatcher, tokenizer, reward: RewardComputer,
                   kl: KLPenalty | None) -> SyncSchedule:
    """The experience maker over ``cluster``'s engines and the schedule that drives it (``--train.async_enable``):
    at set-up, and again after the rank groups restarted (``--train.max_restarts``: nothing of the old schedule's
    batches in flight survives; the resumed checkpoint brings them back)."""
    from openrlhf_shape.trainer.experience import ShapeExperienceMaker
    from openrlhf_shape.trainer.schedule import make_schedule

    engines, lifecycle, sampling = cluster.engines, cluster.lifecycle, cfg.rollout.sampling_config()
    if cfg.shape.entropy_source == "engine":  # segmentation and TCR read the engines' entropies (trainer/experience.py)
        sampling = dataclasses.replace(sampling, entropies=True)
    # The maker's forwards (old and reference log-probs) run inside the colocation lifecycle.
    maker = ShapeExperienceMaker(cfg.advantage_estimator(), sampling, cfg.probe, engines, lifecycle.logprobs, reward,
                                 tokenizer, shaping=cfg.reward_shaping(), rollout_correction=cfg.rollout_correction(),
                                 agent=build_agent(cfg, tokenizer), kl=kl,
                                 ref_logprobs_fn=lifecycle.ref_logprobs if kl is not None else None,
                                 values_fn=lifecycle.critic_values if cluster.critics is not None else None)
    return make_schedule(cfg, maker, batcher, engines, sampling, tokenizer, lifecycle.logprobs)
