"""Validation of a :class:`~openrlhf_shape.config.tree.TrainConfig` across sections.

Each section validates its own fields when built; what spans sections (batch divisibility, the
layout, the backend, the appendix-A.2 bound with the probe count) is checked here, once. Every
message starts with the flag a user types.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import TYPE_CHECKING, Callable

from openrlhf_shape.algorithms.estimators import AdvantageEstimator, names_with
from openrlhf_shape.config.openrlhf import show
from openrlhf_shape.rollout.probes import AGENT_PROBE_SCORER
from openrlhf_shape.weight_sync import TRANSPORTS

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.config.tree import TrainConfig
    from openrlhf_shape.platform import Platform


def _need(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"--{flag}: {msg}")


def reworded(build: Callable, cls_name: str, to_flag: Callable[[str], str]):
    """``build()``; a ``ValueError`` naming ``cls_name.field`` is re-raised naming ``--<to_flag(field)>``."""
    try:
        return build()
    except ValueError as exc:
        msg = re.sub(rf"\b{cls_name}\.(\w+)", lambda m: "--" + to_flag(m.group(1)), str(exc))
        raise ValueError(msg) from None


def validate(cfg: "TrainConfig", check_paths: bool = True) -> None:
    """Every check that needs no model or devices; raises ``ValueError`` naming the flag."""
    estimator = cfg.advantage_estimator()  # a known name; the bounds and return settings that apply to it
    _check_critic(cfg, estimator)
    cfg.data.validate()
    _check_rollout(cfg, estimator)
    _check_batches(cfg)
    replica = _check_backend(cfg)
    _check_loop(cfg, check_paths)
    _check_probes(cfg, estimator)
    _check_kl(cfg, replica)
    _check_critic_ranks(cfg, replica)
    _check_reward_model(cfg, replica, check_paths)
    _check_reward_shaping(cfg, estimator)
    _check_paths(cfg, check_paths)
    _check_agent(cfg, check_paths)


def _check_critic(cfg: "TrainConfig", estimator: AdvantageEstimator) -> None:
    """``--critic.*`` only with an estimator that reads a critic (a setting that does nothing is an error)."""
    given = _changed(dataclasses.asdict(cfg.critic), dataclasses.asdict(type(cfg.critic)()), "critic.")
    given += ["train.colocate_critic_reward"] if cfg.train.colocate_critic_reward else []
    name = cfg.algo.advantage.estimator
    _need(estimator.needs_critic or not given, given[0] if given else "",
          f"only --algo.advantage.estimator {' or '.join(names_with('needs_critic'))} trains a critic, and the run's "
          f"estimator is {name} (OpenRLHF's default is gae, ours shape): pass --algo.advantage.estimator gae, or drop "
          + ", ".join(f"--{g}" for g in given))


def _check_critic_ranks(cfg: "TrainConfig", mp: int) -> None:
    """gae's critic ranks: as the reference's (a multiple of the actor's TP x PP x CP ``mp``; colocated, one per actor
    rank); under ``--train.colocate_critic_reward`` with a reward model, as many as the reward model's."""
    if not cfg.advantage_estimator().needs_critic:
        return
    world = cfg.actor.world_size
    ranks, rm = cfg.critic.world_size(world), cfg.reward.world_size(world)
    _check_side_ranks(cfg, "the critic", "critic", ranks, mp, "--critic.*")
    _need(not (cfg.train.colocate_critic_reward and cfg.reward.model_name_or_path and not cfg.train.colocate_all)
          or ranks == rm, "train.colocate_critic_reward",
          f"critic rank r shares reward rank r's GPU (OpenRLHF's rule): --critic.num_nodes x --critic.num_gpus_per_node "
          f"= {ranks} must equal --reward.num_nodes x --reward.num_gpus_per_node = {rm}")


def _changed(ours: dict, default: dict, prefix: str) -> list[str]:
    """The dotted flags whose value in ``ours`` (a section's ``asdict``) differs from ``default``'s."""
    out: list[str] = []
    for key, value in ours.items():
        if isinstance(value, dict):
            out += _changed(value, default[key], f"{prefix}{key}.")
        elif value != default[key]:
            out.append(prefix + key)
    return out


def _check_rollout(cfg: "TrainConfig", estimator: AdvantageEstimator) -> None:
    r, a = cfg.rollout, cfg.algo.advantage
    reworded(r.sampling_config, "SamplingConfig",
             lambda f: {"n": "rollout.n_samples_per_prompt", "max_tokens": "rollout.max_new_tokens"}.get(f, f"rollout.{f}"))
    if estimator.needs_group or (estimator.needs_segments and cfg.shape.outcome_baseline != "none"):
        _need(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt",
              f"--algo.advantage.estimator {a.estimator} and group baselines compare the samples of a prompt: "
              "they need >= 2 samples per prompt")
    _need(r.batch_size >= 1, "rollout.batch_size", "must be >= 1 prompt per step")
    _need(cfg.vllm.num_engines >= 1, "vllm.num_engines", "must be >= 1")
    _need(r.temperature > 0, "rollout.temperature", "must be > 0 (entropy is taken at this temperature)")
    cfg.rollout_correction().validate()
    if a.is_correction_level != "off":
        _need(r.top_p >= 1 and r.top_k in (-1, 0), "algo.advantage.is_correction_level",
              "needs --rollout.top_p 1 and --rollout.top_k -1: under top-p/top-k vLLM's log-probs are of the "
              "truncated distribution, so every importance weight would carry the truncation mass")
    _need(r.weight_sync_timeout > 0, "rollout.weight_sync_timeout",
          f"{r.weight_sync_timeout}: use a positive number of seconds (the longest a weight sync may go without a bucket completing)")
    _need(r.max_engine_restarts >= 0, "rollout.max_engine_restarts",
          f"{r.max_engine_restarts}: use 0 (a dead engine stops the run) or how many dead engines the run may replace")
    _need(r.engine_stall_timeout >= 0, "rollout.engine_stall_timeout",
          f"{r.engine_stall_timeout}: use 0 (engines not watched) or the seconds an engine may go without a step in a call")
    _need(cfg.train.max_restarts >= 0, "train.max_restarts",
          f"{cfg.train.max_restarts}: use 0 (a dead rank stops the run) or how many times the run may restart its ranks")
    _need(r.max_logprob_gap >= 0, "rollout.max_logprob_gap",
          f"{r.max_logprob_gap}: use 0 (warn past the dtype's expected gap) or a gap in nats past which the run stops")
    transport = TRANSPORTS.get(r.weight_sync)  # what each needs of the layout: weight_sync.choose_transport
    _need(r.weight_sync == "auto" or transport is not None, "rollout.weight_sync",
          f"{r.weight_sync!r}: use auto or a registered transport ({', '.join(TRANSPORTS)})")
    _need(transport is None or not transport.same_gpu_only or cfg.train.colocate_all, "rollout.weight_sync",
          f"{r.weight_sync} needs --train.colocate_all (sender and engine worker on the same GPU)")


def _check_batches(cfg: "TrainConfig") -> None:
    r, t = cfg.rollout, cfg.train
    samples = r.batch_size * r.n_samples_per_prompt
    _need(t.batch_size >= 1, "train.batch_size", "must be >= 1")
    # A batch that does not divide the step's samples drops the rest each pass (OpenRLHF's drop_last; the console says
    # so at start-up): every step trains a full rollout batch, dynamic filtering refilling what it drops.
    _need(t.batch_size <= samples, "train.batch_size",
          f"{t.batch_size} is more than the {samples} samples of a step (--rollout.batch_size x "
          f"--rollout.n_samples_per_prompt): no mini-batch would fill (e.g. --train.batch_size {samples})")
    _need(cfg.algo.dynamic_filtering_max_rounds >= 1, "algo.dynamic_filtering_max_rounds",
          f"{cfg.algo.dynamic_filtering_max_rounds}: use >= 1 (refill rounds a step may take)")
    _need(t.max_epochs >= 1, "train.max_epochs", "must be >= 1")
    for flag, budget in (("train", t.max_tokens_per_gpu), ("rollout", r.max_tokens_per_gpu)):
        if (budget is not None or flag == "train") and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"--{flag}.max_tokens_per_gpu must be an integer >= 1 (tokens of one micro-batch on one "
                             f"GPU), got {budget!r}")
    _need(cfg.actor.world_size >= 1, "actor.num_gpus_per_node",
          "ranks (--actor.num_nodes x --actor.num_gpus_per_node) must be >= 1")


def _check_backend(cfg: "TrainConfig") -> int:
    """The backend, the rank config it builds from the flags (it refuses those it cannot honour) and the ranks
    against its layout; returns the ranks of one data-parallel replica (TP x PP x CP; DeepSpeed: a ring group)."""
    backend = cfg.backend()
    reworded(cfg.optim_config, "OptimConfig", lambda f: f"actor.{f}")  # the settings against the schedule's length
    reworded(cfg.megatron_config, "MegatronConfig", lambda f: f"megatron.{f}")  # the --megatron.* section as a whole
    mp, world = backend.rank_config(cfg).ranks_per_replica, cfg.actor.world_size
    _need(world % mp == 0, "actor.num_gpus_per_node",
          f"{world} ranks is not a multiple of TP x PP x CP = {mp}; set --actor.num_nodes x "
          "--actor.num_gpus_per_node to TP x PP x CP x DP, or change the context-parallel size "
          "(--megatron.context_parallel_size; --ds.ring_attn_size on --actor.backend deepspeed)")
    dp = world // mp
    _need(cfg.train.batch_size % dp == 0, "train.batch_size",
          f"{cfg.train.batch_size} is not divisible by the data-parallel size {dp} (world / (TP x PP x CP))")
    return mp


def _check_loop(cfg: "TrainConfig", check_paths: bool) -> None:
    t, e, c = cfg.train, cfg.eval, cfg.ckpt
    _need(cfg.data.max_prompt_len is not None, "data.max_prompt_len", "must be set (tokens; it sizes the engines)")
    _need(t.num_steps >= 1, "train.num_steps", "must be >= 1")
    _need(c.save_steps >= 0 and e.steps >= 0, "ckpt.save_steps", "save/eval steps must be >= 0")
    _need(e.n_samples_per_prompt >= 1, "eval.n_samples_per_prompt", "must be >= 1 response per held-out problem")
    _need(e.temperature >= 0, "eval.temperature", "must be >= 0 (0 is greedy)")
    _need(0 < e.top_p <= 1, "eval.top_p", "must lie in (0, 1]")
    _need(not ((e.val_before_train or e.steps) and e.max_samples == 0), "eval.max_samples",
          "is 0 but an eval is asked for (--eval.steps / --eval.val_before_train); raise it or use None")
    _need(c.max_num >= 1, "ckpt.max_num", "must keep at least 1 checkpoint")
    _need(not check_paths or c.resume in ("auto", "none") or os.path.isdir(c.resume), "ckpt.resume",
          f"{c.resume!r} is neither 'auto', 'none' nor an existing checkpoint directory")
    _need(t.gpus_per_node >= 1, "train.gpus_per_node", "must be >= 1")
    _need(t.max_staleness in (1, 2), "train.max_staleness",
          f"{t.max_staleness}: 1 (generation and scoring of the next batch overlap the update) or 2 (its probes too); "
          "a deeper queue adds staleness and hides nothing more (docs/architecture.md, 'Asynchronous training')")
    _need(not (t.async_enable and t.colocate_all), "train.async_enable",
          "needs a disaggregated layout: with --train.colocate_all the engines and the ranks share the GPUs, so "
          "nothing can overlap; drop --train.colocate_all (and give the engines their own GPUs) or drop --train.async_enable")
    _check_partial(cfg)
    if cfg.reward.num_workers < 0:
        raise ValueError(f"--reward.num_workers: must be >= 1, or 0 for one per core; got {cfg.reward.num_workers}")


def _check_partial(cfg: "TrainConfig") -> None:
    """``--train.partial_rollout_enable``: asynchronous training, a cut inside the response budget, and nothing whose
    meaning a cut would change (stop strings, the engines' MoE routing). With an agent nothing is cut
    (:meth:`TrainConfig.partial_chunk_in_effect`; ``compat.implied`` says so)."""
    t, r = cfg.train, cfg.rollout
    if r.partial_chunk_tokens is not None:
        _need(t.partial_rollout_enable, "rollout.partial_chunk_tokens", "is read only with --train.partial_rollout_enable")
        _need(1 <= r.partial_chunk_tokens <= r.max_new_tokens, "rollout.partial_chunk_tokens",
              f"{r.partial_chunk_tokens}: must lie in [1, --rollout.max_new_tokens {r.max_new_tokens}]")
    if not t.partial_rollout_enable:
        return
    _need(t.async_enable, "train.partial_rollout_enable",
          "requires --train.async_enable (as in OpenRLHF): responses continue across the weight syncs that the "
          "asynchronous schedule runs beside generation; add --train.async_enable or drop the flag")
    if t.agent_func_path:  # episodes run whole: no cut, nothing below applies
        return
    _need(not r.stop, "train.partial_rollout_enable",
          "cannot honour --rollout.stop strings: a string across a round's cut would be missed; use "
          "--rollout.stop_token_ids or drop --rollout.stop")
    _need(cfg.megatron.routing_replay != "r3", "megatron.routing_replay",
          "r3 replays the engines' routing of one generate call per sample; a partial rollout spans several rounds "
          "and weight versions: use r2 with --train.partial_rollout_enable")
    _need(cfg.shape.entropy_source != "engine", "shape.entropy_source",
          "engine: a partial rollout's response is drawn over several rounds whose entropies are not joined yet "
          "(rollout/partial.py); use --shape.entropy_source trainer with --train.partial_rollout_enable")


def _check_kl(cfg: "TrainConfig", mp: int) -> None:
    """The KL settings, and the reference ranks' layout: the actor's TP x PP x CP (``mp``) must divide them;
    colocated, they sit on the actor's GPUs one for one (OpenRLHF's rule)."""
    k = cfg.algo.kl
    cfg.kl_penalty(), cfg.kl_controller()  # estimator, unbiased_gradient; init_coef, target, horizon (errors name the flag)
    if not k.enabled:
        return
    _check_side_ranks(cfg, "the reference", "ref", cfg.ref.world_size(cfg.actor.world_size), mp, "--ref.*")


def _check_side_ranks(cfg: "TrainConfig", part: str, section: str, ranks: int, mp: int, unset: str) -> None:
    """A forward-only rank group on the actor's layout (the reference, the reward model): ``ranks``
    (``--<section>.num_nodes`` x ``num_gpus_per_node``) a multiple of TP x PP x CP ``mp``; colocated, one per actor
    rank."""
    world, flags = cfg.actor.world_size, f"--{section}.num_nodes x --{section}.num_gpus_per_node"
    _need(ranks >= 1 and ranks % mp == 0, f"{section}.num_gpus_per_node",
          f"{part} runs the actor's layout, so its {ranks} ranks ({flags}) must be a multiple of TP x PP x CP = {mp}")
    _need(not cfg.train.colocate_all or ranks == world, f"{section}.num_gpus_per_node",
          f"with --train.colocate_all {part} shares the actor's GPUs one for one: {flags} = {ranks} must equal "
          f"--actor.num_nodes x --actor.num_gpus_per_node = {world} (or leave both {unset} unset)")


def _check_reward_model(cfg: "TrainConfig", mp: int, check_paths: bool) -> None:
    """``--reward.model_name_or_path``: one reward path (not with ``--reward.remote_url``), a directory, and ranks laid
    out as the reference's (a multiple of the actor's TP x PP x CP; colocated, one per actor rank)."""
    r, world = cfg.reward, cfg.actor.world_size
    if not r.model_name_or_path:
        _need(not r.normalize_enable, "reward.normalize_enable", "normalises a reward model's score: it needs "
              "--reward.model_name_or_path (a reward function's rewards are never normalised, as in OpenRLHF)")
        return
    _need(not r.remote_url, "reward.model_name_or_path",
          "and --reward.remote_url are two reward paths; give one: the reward model scores token ids, the reward "
          "function or server scores decoded queries")
    _need(not check_paths or r.model_name_or_path == "demo" or os.path.isdir(r.model_name_or_path),
          "reward.model_name_or_path", f"{r.model_name_or_path} is not a reward model directory (OpenRLHF's format)")
    _check_side_ranks(cfg, "the reward model", "reward", r.world_size(world), mp, "--reward.num_*")


def _check_reward_shaping(cfg: "TrainConfig", estimator: AdvantageEstimator) -> None:
    """``--reward.stop_properly_penalty_coef``: OpenRLHF's range, and the [0, 1] outcome SHAPE/MRT need."""
    coef = cfg.reward.stop_properly_penalty_coef
    if coef is None:
        return
    _need(coef <= 1, "reward.stop_properly_penalty_coef",
          f"{coef}: use a factor in [0, 1] (a truncated response's reward is multiplied by it) or a negative number "
          "(a truncated response's reward is set to it), as in OpenRLHF")
    _need(coef >= 0 or not estimator.needs_segments, "reward.stop_properly_penalty_coef",
          f"{coef} would set truncated responses' reward to {coef}, but {cfg.algo.advantage.estimator} uses the outcome "
          "as the final potential, so rewards must lie in [0, 1]: use a factor in [0, 1], or "
          "--algo.advantage.estimator group_norm")


def _check_probes(cfg: "TrainConfig", estimator: AdvantageEstimator) -> None:
    """Appendix A.2 against the most probes a state can get: m, or the adaptive cap; and who judges the probes
    (``--probe.scorer``): an agent's environment cannot, so with an agent the user names the verifier."""
    p = cfg.probe
    if estimator.needs_segments and cfg.train.agent_func_path and p.scorer == "auto":
        raise ValueError(AGENT_PROBE_SCORER)
    rule = p.rule()
    if rule is None:
        estimator.check_reward_sign(p.num_probes, "--probe.num_probes")
    else:
        estimator.check_reward_sign(rule.max_probes, "--probe.max_probes" if p.max_probes else "--probe.num_probes")


def _check_paths(cfg: "TrainConfig", check_paths: bool) -> None:
    source, model = cfg.data.prompt_dataset, cfg.actor.model_name_or_path
    if source.startswith("bundled:"):
        _need(source in ("bundled:train", "bundled:test"), "data.prompt_dataset",
              "bundled data is 'bundled:train' or 'bundled:test'")
    elif check_paths and not os.path.exists(source) and source.endswith((".jsonl", ".json", ".parquet")):
        raise FileNotFoundError(f"--data.prompt_dataset: file {source} does not exist")
    if check_paths and model != "demo" and not os.path.isdir(model):
        raise FileNotFoundError(
            f"--actor.model_name_or_path: {model} is not a Hugging Face model directory (or use 'demo')")


def _check_agent(cfg: "TrainConfig", check_paths: bool) -> None:
    """An agent file is a .py file (OpenRLHF loads nothing else); its episodes cannot replay MoE routing."""
    path = cfg.train.agent_func_path
    if not path:
        return
    _need(str(path).endswith(".py"), "train.agent_func_path",
          f"{path!r}: give a .py file that defines AgentExecutor (OpenRLHF's agent interface)")
    _need(not check_paths or os.path.isfile(path), "train.agent_func_path", f"file {path} does not exist")
    _need(cfg.megatron.routing_replay != "r3", "megatron.routing_replay",
          "r3 replays the engines' routing of one generate call per sample; an agent's episode spans several "
          "calls and the environment's replies: use r2 with --train.agent_func_path")
    _need(cfg.shape.entropy_source != "engine", "shape.entropy_source",
          "engine: an agent's turns are sampled with the agent's own sampling params, which ask for no entropies; "
          "use --shape.entropy_source trainer with --train.agent_func_path")


def check_dtypes(cfg: "TrainConfig", platform: "Platform") -> str | None:
    """The training dtype against the run's devices (``platform``: the profile the driver decided), at start-up.

    A dtype the backend cannot run there is refused by its record (Megatron: bf16 on a CPU run), before any rank
    starts, naming the flag. bf16 a CPU only emulates (DeepSpeed runs it: one ZeRO-3 update of 16 short samples took
    ~370 s on the 2-core machine) is said in one warning naming the flag that avoids it, and returned. None: nothing
    to say."""
    backend = cfg.backend()
    if backend.trainer_dtype(cfg, platform) != "bfloat16" or platform.on_gpu:
        return None
    flag = backend.dtype_flag
    said = (f"--{flag} {show(cfg.get(flag))} on a CPU run: this CPU only emulates bf16, so every update is many times "
            "slower than in fp32 (one ZeRO-3 update of 16 short samples took ~370 s on a 2-core machine); leave "
            f"--{flag} unset (auto: fp32 on CPU, bf16 on GPU) to avoid it")
    logging.getLogger(__name__).warning("%s", said)
    return said
