"""OpenRLHF 0.11.2's PPO flags (``openrlhf.cli.train_ppo_ray``), each with what this trainer does
with it: the same setting under the same name, a setting that is always on here (accepted, no
effect), accepted only for some values, or refused with one line saying why and what to use.

This is data: the config parser (config/compat.py) reads it; the flag table of docs/openrlhf_compat.md and the test
that checks every OpenRLHF flag is covered are generated from / checked against it.

Kinds:
    ``same``     our flag of the same name and meaning (``ours`` names it when a value is translated,
                 e.g. a ``-1`` "off" that is ``0`` here).
    ``always``   what the flag turns on is always on here; accepted, no effect.
    ``values``   accepted for the values in ``accept`` (OpenRLHF value -> our value, ``None`` = no
                 effect); other values refused with ``why``.
    ``refused``  a part this trainer does not have; ``why`` says why and what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SAME, ALWAYS, VALUES, REFUSED = "same", "always", "values", "refused"


@dataclass(frozen=True)
class OpenRLHFFlag:
    name: str  # without the leading --
    default: Any  # OpenRLHF 0.11.2's default
    kind: str
    ours: str | None = None  # our flag (same / values kinds); None: the same name
    why: str = ""  # refusal reason + what to use, or what "always" means
    accept: dict[Any, Any] = field(default_factory=dict)  # values kind: OpenRLHF value -> our value


_NO_CRITIC = ("no critic here; use a critic-free --algo.advantage.estimator (group_norm, reinforce, reinforce_baseline, "
              "rloo, dr_grpo, flash_reinforce, shape, mrt)")
_REF_RANKS = ("the reference model's ranks (started when --algo.kl.init_coef > 0; unset: as many as the actor's): "
              "the actor's backend and TP/PP layout, on the actor's GPUs under --train.colocate_all, else on their own")
_REF_OFFLOAD = ("under --train.colocate_all the colocation lifecycle keeps the reference's parameters in host memory "
                "except during its forward; without it they stay on the reference's own GPUs; drop it")
_REF_COLOCATE = ("the reference shares the actor's GPUs under --train.colocate_all (offloaded by the colocation "
                 "lifecycle); without it, it runs on its own GPUs (--ref.num_nodes x --ref.num_gpus_per_node)")
_NO_RM = "no reward-model actor here; rewards come from Math-Verify or --reward.remote_url (a reward_func .py or HTTP server)"
_DS = "not a switch of this trainer's DeepSpeed backend (--actor.backend deepspeed: ZeRO 0-3, adam offload, bf16/fp32, gradient checkpointing)"
_NO_VLM = "text-only: vision-language models are not supported"
_NO_LORA = "LoRA / 4-bit loading are not supported on either backend: full fine-tuning"
_TOKEN_BUDGET = "micro-batches are packed by a token budget here (--train.max_tokens_per_gpu)"
# The flags of the "Long reasoning" work (issue 36): refused until it lands, with this reason.
_LONG = 'comes with the "Long reasoning" work (issue 36), not yet here'
_NO_RM_NORM = ("OpenRLHF divides the reward model's (and critic's) output by the mean/std stored in its config.json; "
               f"a reward_func is never normalised; {_NO_RM}")
_SLEEP = ("whenever --train.colocate_all is set the engines sleep while the ranks work and the ranks (either backend) "
          "offload to host while the engines generate; without colocation nothing shares their GPUs (OpenRLHF, too, "
          "turns vLLM's sleep off then)")


def _f(name: str, default: Any, kind: str, ours: str | None = None, why: str = "", accept: dict | None = None) -> OpenRLHFFlag:
    return OpenRLHFFlag(name, default, kind, ours, why, dict(accept or {}))


def _critic_optim() -> list[OpenRLHFFlag]:
    rows = [("optim", "adam"), ("muon.lr", 0.02), ("muon.momentum", 0.95), ("muon.ns_steps", 5),
            ("muon.nesterov", True), ("muon.no_nesterov", True), ("adam.lr", 9e-6), ("adam.betas", (0.9, 0.95)),
            ("adam.eps", 1e-8), ("adam.weight_decay", 0.0), ("lr_scheduler", "cosine_with_min_lr"),
            ("lr_warmup_ratio", 0.03), ("min_lr_ratio", 0.1), ("max_norm", 1.0)]
    return [_f(f"critic.{k}", d, REFUSED, why=_NO_CRITIC) for k, d in rows]


OPENRLHF_PPO_FLAGS: tuple[OpenRLHFFlag, ...] = (
    # ---- placement: Ray actor groups
    _f("ref.num_nodes", 1, SAME, why=_REF_RANKS),
    _f("ref.num_gpus_per_node", 8, SAME, why=_REF_RANKS),
    _f("ref.offload", False, REFUSED, why=_REF_OFFLOAD),
    _f("reward.num_nodes", 1, REFUSED, why=_NO_RM),
    _f("reward.num_gpus_per_node", 8, REFUSED, why=_NO_RM),
    _f("reward.offload", False, REFUSED, why=_NO_RM),
    _f("reward.model_name_or_path", None, REFUSED, why=_NO_RM),
    _f("critic.num_nodes", 1, REFUSED, why=_NO_CRITIC),
    _f("critic.num_gpus_per_node", 8, REFUSED, why=_NO_CRITIC),
    _f("critic.model_name_or_path", None, REFUSED, why=_NO_CRITIC),
    _f("critic.value_clip", 0.5, REFUSED, why=_NO_CRITIC),
    _f("critic.freezing_steps", -1, REFUSED, why=_NO_CRITIC),
    _f("critic.save_value_network", False, REFUSED, why=_NO_CRITIC),
    *_critic_optim(),
    _f("actor.num_nodes", 1, SAME, why="Megatron ranks = num_nodes x num_gpus_per_node = TP x PP x DP"),
    _f("actor.num_gpus_per_node", 8, SAME, why="Megatron ranks = num_nodes x num_gpus_per_node = TP x PP x DP"),
    _f("train.colocate_all", False, SAME, why="vLLM engines sleep while the actor ranks train on the same GPUs; with "
       "--train.async_enable, as in OpenRLHF, only the training models share GPUs and the engines get their own"),
    _f("train.colocate_actor_ref", False, REFUSED, why=_REF_COLOCATE),
    _f("train.colocate_critic_reward", False, REFUSED, why=_NO_CRITIC),
    # ---- vLLM
    _f("vllm.num_engines", None, SAME),
    _f("vllm.tensor_parallel_size", 1, SAME),
    _f("vllm.gpu_memory_utilization", 0.95, SAME),
    _f("vllm.enforce_eager", False, SAME),
    _f("vllm.enable_prefix_caching", False, SAME, why="on by default here: the potential probes rely on it"),
    _f("vllm.enable_sleep", False, ALWAYS, why=_SLEEP),
    _f("vllm.sync_backend", "nccl", VALUES, accept={"nccl": None},
       why="weights go to vLLM through the trainer's streamed weight sync (--rollout.weight_sync: a collective group "
           "over NCCL, gloo on CPU; the object store; CUDA IPC when colocated)"),
    _f("vllm.sync_with_ray", False, REFUSED,
       why="the weight-sync path is --rollout.weight_sync (auto: a collective group, NCCL on GPU, gloo on CPU); drop it"),
    # ---- rollout-correction (TIS / ICEPOP / sequence mask)
    _f("algo.advantage.is_correction_level", "off", SAME),
    _f("algo.advantage.is_correction_mode", "mask", SAME),
    _f("algo.advantage.is_correction_gating", "ratio", SAME),
    _f("algo.advantage.is_correction_threshold", [0.5, 5.0], SAME),
    # ---- async
    _f("train.async_enable", False, SAME, why="one step off: the next batch is made while the ranks train (docs/architecture.md); "
       "with --train.colocate_all the engines get their own GPUs, as in OpenRLHF"),
    _f("train.async_queue_size", 1, REFUSED,
       why="the depth of the asynchronous pipeline is --train.max_staleness (1 or 2); drop it"),
    _f("train.partial_rollout_enable", False, SAME,
       why="with --train.async_enable: responses still running at a weight sync continue under the new weights, "
           "each token's policy version recorded; cut deterministically every --rollout.partial_chunk_tokens "
           "(ours; OpenRLHF cuts where the broadcast lands in time), so resume repeats the run (rollout/partial.py)"),
    _f("rollout.vllm_generate_batch_size", None, REFUSED,
       why="one generation batch per step (= --rollout.batch_size), with or without --train.async_enable; drop it"),
    # ---- checkpoints, eval, logging
    _f("eval.steps", -1, SAME, why="-1 (OpenRLHF's off) is 0 here"),
    _f("ckpt.save_steps", -1, SAME, why="-1 (OpenRLHF's off) is 0 here (a final checkpoint is always written)"),
    _f("ckpt.path", "./ckpt/checkpoints_ppo_ray", SAME, why="Megatron distributed checkpoints (default <ckpt.output_dir>/checkpoints)"),
    _f("ckpt.output_dir", "./ckpt", SAME, why="the run directory: metrics, checkpoints, HF export, train.log"),
    _f("ckpt.save_hf", False, SAME, why="export Hugging Face weights (here: at the end of the run)"),
    _f("ckpt.max_num", 3, SAME),
    _f("ckpt.load_enable", False, SAME, why="resume from the newest complete checkpoint under --ckpt.path"),
    _f("ckpt.disable_ds", False, REFUSED, why="checkpoints always hold the optimizer state (exact resume); drop it"),
    _f("ckpt.max_mem", float("inf"), REFUSED, why="no size cap on checkpoints; use --ckpt.max_num"),
    _f("ckpt.best_metric_key", "", REFUSED, why="best-checkpoint selection is not implemented; use --ckpt.max_num and eval metrics"),
    _f("logger.logging_steps", 1, VALUES, accept={1: None}, why="metrics are logged every step"),
    _f("logger.wandb.key", None, REFUSED, why="give the key as the WANDB_API_KEY environment variable (a config is printed and saved)"),
    _f("logger.wandb.org", None, SAME),
    _f("logger.wandb.group", None, SAME),
    _f("logger.wandb.project", "openrlhf_train_ppo", SAME, why="W&B logging is on when a project is given"),
    _f("logger.wandb.run_name", "ppo_%m%dT%H:%M", SAME),
    _f("logger.tensorboard_dir", None, SAME),
    # ---- DeepSpeed and model-loading switches of the DeepSpeed actor
    _f("local_rank", -1, REFUSED, why="ranks are placed by Ray (no deepspeed launcher); drop it"),
    _f("ds.use_universal_ckpt", False, REFUSED, why="universal checkpoints are not written; resume a DeepSpeed checkpoint with the same --ds.zero_stage and rank count"),
    _f("ds.zero_stage", 2, SAME, why="ZeRO stage of --actor.backend deepspeed (0-3); given without --actor.backend it selects "
       "the DeepSpeed backend (OpenRLHF's); on Megatron shard with --megatron.use_distributed_optimizer"),
    _f("ds.deepcompile", False, REFUSED, why=f"{_DS}: the model runs eagerly; drop it"),
    _f("ds.param_dtype", "bf16", SAME, why="bf16 or fp32 (default auto: bf16 on GPU, fp32 on CPU); fp16 is refused (no loss scaling); Megatron picks the same automatically"),
    _f("ds.zpg", 1, REFUSED, why=f"{_DS}: ZeRO++ hierarchical partitioning is not configured; drop it"),
    _f("ds.adam_offload", False, SAME, why="Adam states in host memory (DeepSpeedCPUAdam) with --actor.backend deepspeed; "
       "given without --actor.backend it selects the DeepSpeed backend"),
    _f("ds.attn_implementation", "flash_attention_2", SAME, why="the HF attention kernel of --actor.backend deepspeed (default sdpa); Megatron picks its own"),
    _f("ds.experts_implementation", None, REFUSED, why="dense models only (no MoE); drop it"),
    _f("ds.use_liger_kernel", False, REFUSED, why=f"{_DS}: the chunked log-prob head already avoids full logits; drop it"),
    _f("ds.grad_accum_dtype", None, REFUSED, why=f"{_DS}: gradients are reduced once per step into the fp32 master partitions; drop it"),
    _f("ds.overlap_comm", False, REFUSED, why=f"{_DS}: gradients are reduced once, after the last micro-batch; drop it"),
    _f("ds.enable_sleep", False, ALWAYS, why=_SLEEP),
    _f("ds.tensor_parallel_size", 1, REFUSED, why="the DeepSpeed backend is data-parallel only; for TP use --actor.backend megatron --megatron.tensor_model_parallel_size"),
    _f("ds.packing_samples", False, ALWAYS, why="a micro-batch's samples are concatenated into one row without padding wherever the attention supports it (Megatron: THD; DeepSpeed: HF position-id packing; docs/packing.md)"),
    _f("ds.ring_attn_size", 1, SAME, why="ring attention (context parallelism) on --actor.backend deepspeed: groups of this "
       "many ranks split each packed micro-batch into contiguous pieces and all-gather K/V (torch on CPU; "
       "docs/context_parallel.md); on Megatron use --megatron.context_parallel_size"),
    _f("ds.ring_attn_head_stride", 1, SAME, why="KV heads all-gathered at once under --ds.ring_attn_size (must divide the "
       "model's KV heads)"),
    _f("ds.value_head_prefix", "score", REFUSED, why=_NO_CRITIC),
    _f("ds.load_in_4bit", False, REFUSED, why=_NO_LORA),
    _f("ds.lora.rank", 0, REFUSED, why=_NO_LORA),
    _f("ds.lora.alpha", 16, REFUSED, why=_NO_LORA),
    _f("ds.lora.target_modules", "all-linear", REFUSED, why=_NO_LORA),
    _f("ds.lora.dropout", 0, REFUSED, why=_NO_LORA),
    _f("actor.gradient_checkpointing_enable", False, SAME, ours="actor.gradient_checkpointing_enable",
       why="activation recompute on either backend (Megatron recompute; HF gradient checkpointing under DeepSpeed)"),
    _f("actor.gradient_checkpointing_reentrant", False, REFUSED,
       why="activation recompute is non-reentrant on both backends; use --actor.gradient_checkpointing_enable"),
    _f("train.enable_ema", False, REFUSED, why="EMA weights are not implemented; drop it"),
    _f("train.ema_beta", 0.992, REFUSED, why="EMA weights are not implemented; drop it"),
    # ---- batching and schedule
    _f("train.dynamic_batch_enable", False, ALWAYS, why=_TOKEN_BUDGET),
    _f("train.max_tokens_per_gpu", 16192, SAME,
       why="prompt + response tokens of one training micro-batch on one data-parallel rank (and of a forward-only one "
           "unless --rollout.max_tokens_per_gpu)"),
    _f("rollout.max_tokens_per_gpu", None, SAME,
       why="prompt + response tokens of one forward-only micro-batch (the old log-probs and entropy pass) on one "
           "data-parallel rank; unset: --train.max_tokens_per_gpu, as in OpenRLHF"),
    _f("rollout.micro_batch_size", 1, ALWAYS, why=_TOKEN_BUDGET),
    _f("train.micro_batch_size", 1, ALWAYS, why=_TOKEN_BUDGET),
    _f("train.num_episodes", 1, SAME, why="passes over the prompt set (sets the number of steps unless --train.num_steps)"),
    _f("rollout.batch_size", 1024, SAME),
    _f("train.batch_size", 128, SAME),
    _f("train.max_epochs", 1, SAME),
    _f("data.max_len", 2048, SAME, why="prompt + response tokens; the response budget when --rollout.max_new_tokens is not given"),
    _f("rollout.max_new_tokens", None, SAME),
    _f("data.max_samples", 100000000, SAME),
    _f("rollout.n_samples_per_prompt", 1, SAME),
    _f("rollout.top_p", 1.0, SAME),
    _f("rollout.temperature", 1.0, SAME),
    _f("train.seed", 42, SAME),
    _f("train.full_determinism_enable", False, REFUSED,
       why="not implemented; runs are reproducible per step from --train.seed (resume redoes a step exactly)"),
    # ---- loss and optimizer
    _f("actor.eps_clip", 0.2, SAME, why="both ends of the clip range (--actor.eps_clip_low_high wins)"),
    _f("actor.eps_clip_low_high", None, SAME),
    _f("actor.dual_clip", None, SAME),
    _f("actor.policy_loss_type", "ppo", VALUES, accept={"ppo": None}, why="only the PPO token loss is implemented (no GSPO)"),
    _f("actor.loss_agg_mode", "token-mean", VALUES, accept={"token-mean": None},
       why="the loss is the token mean over the global mini-batch (the paper's DAPO loss)"),
    _f("actor.aux_loss_coef", 0, VALUES, accept={0: None, 0.0: None}, why="no MoE load-balancing loss (dense models)"),
    _f("actor.entropy_coef", None, VALUES, accept={None: None, 0: None, 0.0: None},
       why="no entropy bonus; entropy is always logged"),
    _f("actor.optim", "adam", VALUES, accept={"adam": None}, why="Megatron's Adam(W) only (no Muon)"),
    _f("actor.muon.lr", 0.02, REFUSED, why="Muon is not available; Megatron's Adam(W) only"),
    _f("actor.muon.momentum", 0.95, REFUSED, why="Muon is not available; Megatron's Adam(W) only"),
    _f("actor.muon.ns_steps", 5, REFUSED, why="Muon is not available; Megatron's Adam(W) only"),
    _f("actor.muon.nesterov", True, REFUSED, why="Muon is not available; Megatron's Adam(W) only"),
    _f("actor.muon.no_nesterov", True, REFUSED, why="Muon is not available; Megatron's Adam(W) only"),
    _f("actor.adam.lr", 1e-6, SAME),
    _f("actor.adam.betas", (0.9, 0.95), SAME),
    _f("actor.adam.eps", 1e-8, SAME),
    _f("actor.adam.weight_decay", 0.0, SAME),
    _f("actor.lr_scheduler", "cosine_with_min_lr", VALUES,
       accept={"cosine_with_min_lr": "cosine", "cosine": "cosine", "constant": "constant",
               "constant_with_warmup": "constant", "linear": "linear"},
       why="Megatron's schedulers: cosine_with_min_lr, constant(_with_warmup), linear"),
    _f("actor.lr_warmup_ratio", 0.03, SAME),
    _f("actor.min_lr_ratio", 0.1, SAME),
    _f("actor.max_norm", 1.0, SAME),
    _f("algo.kl.init_coef", 0.01, SAME,
       why="the default here is 0 (no reference model, no KL: the paper's setting); > 0 starts the reference ranks"),
    _f("algo.kl.use_loss", False, SAME, why="KL in the policy loss; without it -coef x kl per token in the reward"),
    _f("algo.kl.estimator", "k1", SAME, why="k1 | k2 | k3 with OpenRLHF's clamping (openrlhf_shape/algorithms/kl.py)"),
    _f("algo.kl.unbiased_gradient", False, SAME, why="with --algo.kl.use_loss only"),
    _f("algo.kl.target", None, SAME, why="the adaptive KL controller (unset: a fixed coefficient)"),
    _f("algo.kl.horizon", 10000, SAME, why="the adaptive KL controller's horizon in samples"),
    # ---- advantages
    _f("algo.advantage.estimator", "gae", VALUES, ours="algo.advantage.estimator",
       accept={"group_norm": "group_norm", "grpo": "group_norm", "reinforce": "reinforce",
               "reinforce_baseline": "reinforce_baseline", "rloo": "rloo", "dr_grpo": "dr_grpo",
               "flash_reinforce": "flash_reinforce", "shape": "shape", "mrt": "mrt"},
       why="gae needs a critic, and there is none here; the critic-free estimators are OpenRLHF's group_norm (GRPO), "
           "reinforce (REINFORCE++), reinforce_baseline, rloo, dr_grpo, flash_reinforce (its semantics, "
           "docs/algorithms.md) and the paper's shape and mrt"),
    _f("algo.advantage.gamma", 1, SAME,
       why="the return's per-token discount; only reinforce discounts (other estimators refuse a gamma other than 1, "
           "where OpenRLHF resets it to 1 with a warning); SHAPE's own discount is --shape.gamma_min"),
    _f("algo.advantage.lambd", 1, VALUES, accept={1: None, 1.0: None}, why=f"GAE's lambda: {_NO_CRITIC}"),
    _f("algo.advantage.no_std_norm", False, SAME,
       why="whitening without the std division, for reinforce and reinforce_baseline (the estimators that whiten; "
           "refused with the others, which OpenRLHF ignores it for)"),
    _f("algo.dynamic_filtering_enable", False, SAME,
       why="groups outside --algo.dynamic_filtering_range are dropped and new prompts sampled in their place until "
           "--rollout.batch_size groups pass, so every step trains a full batch; a short last mini-batch is dropped "
           "(drop_last) and the LR schedule counts the updates taken. Ours beside it: "
           "--algo.dynamic_filtering_max_rounds (default 32) bounds the refill rounds of a step and stops the run "
           "when the data cannot fill a batch"),
    _f("algo.dynamic_filtering_range", (0, 1), SAME, why="keep a prompt's group when its mean score lies strictly inside"),
    # ---- rewards
    _f("reward.remote_url", None, SAME),
    _f("reward.clip_range", (-10, 10), SAME),
    _f("reward.normalize_enable", False, REFUSED, why=_NO_RM_NORM),
    _f("reward.overlong_buffer_len", None, REFUSED, why="DAPO's overlong penalty is not implemented; drop it"),
    _f("reward.overlong_penalty_factor", 1, VALUES, accept={1: None, 1.0: None},
       why="DAPO's overlong penalty is not implemented"),
    _f("reward.stop_properly_penalty_coef", None, SAME,
       why="responses cut at --rollout.max_new_tokens (finish reason 'length'): reward x coef for coef in [0, 1], "
           "reward = coef for coef < 0; before --reward.clip_range and any baseline, as in OpenRLHF"),
    _f("train.agent_func_path", None, SAME, why="OpenRLHF agent files run unchanged on the engines; the environment's replies get no loss and no credit (the Agents section of this page)"),
    # ---- data and eval
    _f("actor.model_name_or_path", None, SAME),
    _f("data.prompt_dataset", None, SAME),
    _f("data.prompt_probs", None, REFUSED, why="one prompt set per run (no dataset mixing); merge the files first"),
    _f("data.prompt_split", "train", SAME),
    _f("data.input_key", "input", SAME),
    _f("data.label_key", None, SAME),
    _f("data.input_template", None, SAME),
    _f("data.apply_chat_template", False, SAME),
    _f("data.disable_fast_tokenizer", False, REFUSED, why="the fast tokenizer is always used; drop it"),
    _f("data.dataloader_num_workers", 0, VALUES, accept={0: None}, why="prompts are tokenised once at start-up"),
    _f("data.image_key", "images", REFUSED, why=_NO_VLM),
    _f("data.max_images_per_prompt", 0, VALUES, accept={0: None}, why=_NO_VLM),
    _f("actor.freeze_visual_encoder", False, REFUSED, why=_NO_VLM),
    _f("eval.dataset", None, SAME),
    _f("eval.split", "train", SAME),
    _f("eval.temperature", 0.6, SAME),
    _f("eval.n_samples_per_prompt", 4, SAME),
    _f("use_ms", False, REFUSED, why="models load from local directories (no hub downloads)"),
)

BY_NAME: dict[str, OpenRLHFFlag] = {f.name: f for f in OPENRLHF_PPO_FLAGS}
assert len(BY_NAME) == len(OPENRLHF_PPO_FLAGS), "duplicate OpenRLHF flag in the table"


def counts() -> dict[str, int]:
    out: dict[str, int] = {}
    for f in OPENRLHF_PPO_FLAGS:
        out[f.kind] = out.get(f.kind, 0) + 1
    return out


def refusal(name: str, value: Any = None) -> str | None:
    """The one-line refusal for ``--name value`` (None when the flag is accepted)."""
    f = BY_NAME.get(name)
    if f is None:
        return None
    if f.kind == REFUSED:
        return f"--{name}: {f.why}"
    if f.kind == VALUES and not _accepted_value(f, value):
        ok = ", ".join(str(v) for v in f.accept if v is not None) or "none"
        return f"--{name} {value}: {f.why} (accepted here: {ok})"
    return None


def _accepted_value(f: OpenRLHFFlag, value: Any) -> bool:
    if value in f.accept:
        return True
    try:  # "0", "1.0", ... from a command line
        num = float(value)
        return any(isinstance(k, (int, float)) and not isinstance(k, bool) and float(k) == num for k in f.accept)
    except (TypeError, ValueError):
        return str(value) in {str(k) for k in f.accept}


def translated_value(f: OpenRLHFFlag, value: Any) -> Any:
    """For a ``values`` flag: our value for an accepted OpenRLHF value (None: no effect)."""
    if value in f.accept:
        return f.accept[value]
    for k, v in f.accept.items():
        if str(k) == str(value):
            return v
        try:
            if isinstance(k, (int, float)) and float(k) == float(value):
                return v
        except (TypeError, ValueError):
            pass
    raise KeyError(value)


def summary() -> str:
    """One sentence with the table's counts (docs/openrlhf_compat.md carries it above the table)."""
    c = counts()
    return (f"Of OpenRLHF 0.11.2's {len(OPENRLHF_PPO_FLAGS)} PPO flags, {c[SAME]} are honoured under the same name and "
            f"meaning, {c[ALWAYS]} switch on what is always on here (accepted, said once in the log), {c[VALUES]} are "
            f"accepted for the values that match what this trainer does, and {c[REFUSED]} are refused, each with "
            "the reason and what to use.")


def markdown_table() -> str:
    """The table of docs/openrlhf_compat.md: OpenRLHF flag -> ours."""
    lines = ["| OpenRLHF 0.11.2 flag | here |", "| --- | --- |"]
    for f in sorted(OPENRLHF_PPO_FLAGS, key=lambda f: f.name):
        if f.kind == SAME:
            target = f"`--{f.ours or f.name}`" + (f" ({f.why})" if f.why else "")
        elif f.kind == ALWAYS:
            target = f"accepted, always on: {f.why}"
        elif f.kind == VALUES:
            ok = ", ".join(f"`{k}`" for k in f.accept if k is not None)
            target = f"`--{f.ours or f.name}` accepts {ok or 'the default only'}; else refused: {f.why}"
        else:
            target = f"refused: {f.why}"
        lines.append(f"| `--{f.name}` | {target} |")
    return "\n".join(lines)


def render_doc(text: str) -> str:
    """``text`` (docs/openrlhf_compat.md) with its summary sentence and flag table regenerated: the sentence is
    the paragraph that starts "Of OpenRLHF 0.11.2's", the table runs from its header to its last row."""
    lines = text.split("\n")
    head = lines.index(markdown_table().split("\n")[0])
    end = head + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[head:end] = markdown_table().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Of OpenRLHF 0.11.2's"))
    stop = next(i for i in range(start, len(lines)) if not lines[i].strip())
    lines[start:stop] = [summary()]
    return "\n".join(lines)

