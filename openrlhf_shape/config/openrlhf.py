"""OpenRLHF 0.11.2's PPO flags (``openrlhf.cli.train_ppo_ray``), each with what this trainer does
with it: the same setting under the same name, a setting that is always on here (accepted, no
effect), accepted only for some values, or refused with one line saying why and what to use.

This is data: the config parser (config/compat.py) reads it; the flag table of docs/openrlhf_compat.md and the test
that checks every OpenRLHF flag is covered are generated from / checked against it.

Defaults: a flag OpenRLHF has takes OpenRLHF's default here (after the value's translation), unless there is a
reason; then the row is ``own`` and ``why`` states the reason. tests/config/test_openrlhf_defaults.py checks both
against OpenRLHF's own parser: a ``same`` row whose default here differs fails, and so does an ``own`` row whose
default does not. A run that leaves an ``own`` flag unset is told so once at start-up (:func:`compat.own_defaults_note
<openrlhf_shape.config.compat.own_defaults_note>`).

Kinds:
    ``same``     our flag of the same name, meaning and default (``ours`` names it when a value is translated,
                 e.g. a ``-1`` "off" that is ``0`` here).
    ``own``      the same name and meaning, our own default; ``why`` says why (the paper's setting, the demo's
                 model and data, what a CPU needs, ...).
    ``always``   what the flag turns on is always on here; accepted, no effect.
    ``values``   accepted for the values in ``accept`` (OpenRLHF value -> our value, ``None`` = no
                 effect); other values refused with ``why``.
    ``refused``  a part this trainer does not have; ``why`` says why and what to use instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from openrlhf_shape.actor.lr_schedule import SCHEDULES
from openrlhf_shape.algorithms.estimators import ESTIMATOR_REGISTRY

SAME, OWN, ALWAYS, VALUES, REFUSED = "same", "own", "always", "values", "refused"


@dataclass(frozen=True)
class OpenRLHFFlag:
    name: str  # without the leading --
    default: Any  # OpenRLHF 0.11.2's default
    kind: str
    ours: str | None = None  # our flag (same / values kinds); None: the same name
    why: str = ""  # refusal reason + what to use, or what "always" means
    accept: Mapping[Any, Any] = field(default_factory=dict)  # values kind: OpenRLHF value -> our value
    # tests that run OpenRLHF's own installed function and ours on the same inputs ("path::test_name")
    checked_by: tuple[str, ...] = ()


_CRITIC = ("the critic of --algo.advantage.estimator gae, a rank group of the actor's backend and layout (any other "
           "estimator refuses --critic.* and --train.colocate_critic_reward)")
_CRITIC_OPTIM = f"the critic's optimiser, as --actor.*'s; {_CRITIC}"
_CRITIC_RANKS = ("the critic's ranks (unset: as many as the actor's, as the reference's): OpenRLHF's 1 node x 8 GPUs "
                 "would not fit the one-rank default actor; " + _CRITIC)
_REF_RANKS = ("the reference model's ranks (started when --algo.kl.init_coef > 0; unset: as many as the actor's): "
              "the actor's backend and TP/PP layout, on the actor's GPUs under --train.colocate_all, else on their own")
_ACTOR_RANKS = ("ranks = num_nodes x num_gpus_per_node = TP x PP x CP x DP; both unset: one rank, so a bare command "
                "runs on one GPU or the CPU (the demo); one unset: OpenRLHF's 1 node / 8 GPUs per node")
_OFFLOAD = ("parameters in host memory except during its own forward, also on GPUs of its own (under "
            "--train.colocate_all they always are): the colocation lifecycle moves them to the GPU whole for the "
            "forward and back after it (OpenRLHF: DeepSpeed's ZeRO-3 parameter offload, fetched layer by layer)")
_REF_COLOCATE = ("the reference shares the actor's GPUs under --train.colocate_all (offloaded by the colocation "
                 "lifecycle); without it, it runs on its own GPUs (--ref.num_nodes x --ref.num_gpus_per_node)")
_RM = ("an OpenRLHF-format reward model (base model + value head, config.json's mean/std) on ranks of its own: it "
       "scores each sample's prompt + response token ids (eos included, as sampled) at the last token; with "
       "--algo.advantage.estimator shape or mrt each score goes through a sigmoid (R and the probes' potentials must "
       "lie in [0, 1]) and the probes are scored by it too under --probe.scorer auto; not with --reward.remote_url")
_RM_RANKS = ("the reward model's ranks (unset: as many as the actor's): the actor's backend and TP/PP layout, on the "
             "actor's GPUs under --train.colocate_all, else on their own")
_DS = "not a switch of this trainer's DeepSpeed backend (--actor.backend deepspeed: ZeRO 0-3, adam offload, bf16/fp32, gradient checkpointing)"
_NO_VLM = "text-only: vision-language models are not supported"
_NO_LORA = "LoRA / 4-bit loading are not supported on either backend: full fine-tuning"
_TOKEN_BUDGET = "micro-batches are packed by a token budget here (--train.max_tokens_per_gpu)"
# The flags of the "Long reasoning" work (issue 36): refused until it lands, with this reason.
_LONG = 'comes with the "Long reasoning" work (issue 36), not yet here'
_RM_NORM = ("the reward model's score becomes (score - mean) / std with the mean/std of its config.json, as OpenRLHF's "
            "reward model (before the sigmoid of SHAPE/MRT); needs --reward.model_name_or_path: a reward function's "
            "rewards are never normalised")
_SLEEP = ("whenever --train.colocate_all is set the engines sleep while the ranks work and the ranks (either backend) "
          "offload to host while the engines generate; without colocation nothing shares their GPUs (OpenRLHF, too, "
          "turns vLLM's sleep off then)")


def _f(name: str, default: Any, kind: str, ours: str | None = None, why: str = "", accept: Mapping | None = None,
       checked_by: tuple[str, ...] = ()) -> OpenRLHFFlag:
    return OpenRLHFFlag(name, default, kind, ours, why, accept if accept is not None else {}, tuple(checked_by))


# OpenRLHF's names for estimators registered here under another name (its users type them).
ESTIMATOR_ALIASES = {"group_norm": "grpo"}


class RegisteredEstimators(Mapping):
    """``--algo.advantage.estimator``'s accepted values, read from ``ESTIMATOR_REGISTRY`` whenever asked, so an
    estimator registered after this module loaded is accepted too: each name as itself, each alias as its name."""

    def _names(self) -> dict[str, str]:
        names = {n: n for n in ESTIMATOR_REGISTRY}
        return names | {a: n for a, n in ESTIMATOR_ALIASES.items() if n in names}

    def __getitem__(self, value: Any) -> str:
        return self._names()[value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


# Tests that compare with OpenRLHF's own functions (the "machine-checked" marks of docs/openrlhf_compat.md).
_T_RETURNS = "tests/algorithms/test_reinforce_estimators.py::test_equals_openrlhf_compute_advantages_and_returns"
_T_KL_REWARD = "tests/trainer/test_kl_in_reward.py::test_the_makers_kl_in_the_reward_equals_openrlhfs"
_T_KL = "tests/algorithms/test_kl.py::test_estimators_equal_openrlhf"
_T_KL_IN_REWARD = "tests/algorithms/test_kl.py::test_kl_in_the_reward_equals_openrlhf"
_T_KL_UNBIASED = "tests/algorithms/test_kl.py::test_unbiased_gradient_equals_openrlhf"
_T_KL_ADAPTIVE = "tests/algorithms/test_kl.py::test_adaptive_controller_by_hand_and_equal_to_openrlhf"
_T_STOP = "tests/algorithms/test_length_penalty.py::test_equals_openrlhfs_own_function"
_T_AGENT = "tests/rollout/test_agent_batch.py::test_agent_files_load_as_openrlhf_loads_them"
_D = "tests/algorithms/test_openrlhf_differential.py::"
_T_LOSS = (_D + "test_policy_loss_equals_openrlhfs", _D + "test_aggregation_over_micro_batches_equals_openrlhfs")
_T_IS = (_D + "test_rollout_correction_equals_openrlhfs",
         _D + "test_gspo_with_the_correction_takes_the_engines_log_probs_as_openrlhf")
_T_IS_0110 = "tests/config/test_openrlhf_0110_names.py::test_old_names_weigh_the_loss_as_openrlhf_0112_does"
_T_LR = "tests/actor/test_lr_schedule.py::test_lr_at_is_the_scheduler_openrlhf_builds"
_T_GAE = "tests/algorithms/test_gae.py::test_equals_openrlhf_compute_advantages_and_returns"
_T_VALUE_LOSS = "tests/algorithms/test_value_loss.py::test_equals_openrlhfs_value_loss"


def _critic_optim() -> list[OpenRLHFFlag]:
    """``--critic.*``'s optimiser rows: Adam(W) and the schedule as the actor's (same meanings), Muon refused."""
    muon = "Muon is not available; Adam(W) only"
    rows = [_f("critic.optim", "adam", VALUES, accept={"adam": None}, why="Adam(W) only (no Muon), as the actor's")]
    rows += [_f(f"critic.{k}", d, REFUSED, why=muon) for k, d in (("muon.lr", 0.02), ("muon.momentum", 0.95),
             ("muon.ns_steps", 5), ("muon.nesterov", True), ("muon.no_nesterov", True))]
    rows += [_f(f"critic.{k}", d, SAME, why=_CRITIC_OPTIM) for k, d in (("adam.lr", 9e-6), ("adam.betas", (0.9, 0.95)),
             ("adam.eps", 1e-8), ("adam.weight_decay", 0.0), ("lr_warmup_ratio", 0.03), ("min_lr_ratio", 0.1),
             ("max_norm", 1.0))]
    rows.append(_f("critic.lr_scheduler", "cosine_with_min_lr", VALUES, accept={name: name for name in SCHEDULES},
                   why="transformers' schedule of that name, as for --actor.lr_scheduler"))
    return rows


OPENRLHF_PPO_FLAGS: tuple[OpenRLHFFlag, ...] = (
    # ---- placement: Ray actor groups
    _f("ref.num_nodes", 1, OWN, why=_REF_RANKS),
    _f("ref.num_gpus_per_node", 8, OWN, why=_REF_RANKS),
    _f("ref.offload", False, SAME, why=f"the reference model's {_OFFLOAD}"),
    _f("reward.num_nodes", 1, OWN, why=_RM_RANKS),
    _f("reward.num_gpus_per_node", 8, OWN, why=_RM_RANKS),
    _f("reward.offload", False, SAME, why=f"the reward model's {_OFFLOAD}"),
    _f("reward.model_name_or_path", None, SAME, why=_RM),
    _f("critic.num_nodes", 1, OWN, why=_CRITIC_RANKS),
    _f("critic.num_gpus_per_node", 8, OWN, why=_CRITIC_RANKS),
    _f("critic.model_name_or_path", None, SAME, why="where the critic starts (a value head on the policy's "
       f"architecture, OpenRLHF's value-model format loads unchanged); unset: the reward model's when one is given, "
       f"else the actor's (OpenRLHF's rule); {_CRITIC}"),
    _f("critic.value_clip", 0.5, SAME, why=f"the value loss's clip (OpenRLHF's ValueLoss); {_CRITIC}",
       checked_by=(_T_VALUE_LOSS,)),
    _f("critic.freezing_steps", -1, SAME, why="the actor does not train while the critic warms up: as OpenRLHF "
       f"0.11.2, N >= 0 freezes it for the first N + 1 steps (its step count starts at 0), -1 never; {_CRITIC}"),
    _f("critic.save_value_network", False, SAME, why="also save the critic's final weights, in OpenRLHF's value-model "
       f"format, where OpenRLHF puts them: <ckpt.output_dir>_critic; {_CRITIC}"),
    *_critic_optim(),
    _f("actor.num_nodes", 1, OWN, why=_ACTOR_RANKS),
    _f("actor.num_gpus_per_node", 8, OWN, why=_ACTOR_RANKS),
    _f("train.colocate_all", False, SAME, why="vLLM engines sleep while the actor ranks train on the same GPUs; with "
       "--train.async_enable, as in OpenRLHF, only the training models share GPUs and the engines get their own"),
    _f("train.colocate_actor_ref", False, REFUSED, why=_REF_COLOCATE),
    _f("train.colocate_critic_reward", False, SAME, why="the critic and the reward model share GPUs (critic rank r on "
       f"reward rank r's GPU, the two worlds equal; without a reward model the critic keeps its own); {_CRITIC}"),
    # ---- vLLM
    _f("vllm.num_engines", None, OWN, why="OpenRLHF's unset means no vLLM (its HF generate); here every rollout and "
       "probe runs on vLLM engines, so at least one"),
    _f("vllm.tensor_parallel_size", 1, SAME),
    _f("vllm.gpu_memory_utilization", 0.95, OWN,
       why="colocated (--train.colocate_all), the actor's old-log-probs pass runs while the engines are awake (the "
           "probes follow it), so the engines leave room for it; each preset's value is sized by the dry-run planner "
           "(docs/cluster_sizing.md)"),
    _f("vllm.enforce_eager", False, OWN, why="unset: eager on CPU (compiling costs ~140 s there), CUDA graphs on GPU "
       "(OpenRLHF's false)"),
    _f("vllm.enable_prefix_caching", False, OWN, why="the potential probes rely on it: each re-reads its response's "
       "prefix from the cache"),
    _f("vllm.enable_sleep", False, ALWAYS, why=_SLEEP),
    _f("vllm.sync_backend", "nccl", VALUES, accept={"nccl": None},
       why="weights go to vLLM through the trainer's streamed weight sync (--rollout.weight_sync: auto picks a "
           "registered transport per layout, openrlhf_shape/weight_sync/README.md)"),
    _f("vllm.sync_with_ray", False, REFUSED,
       why="the weight-sync path is --rollout.weight_sync (auto picks a transport per layout); drop it"),
    # ---- rollout-correction (TIS / ICEPOP / sequence mask)
    _f("algo.advantage.is_correction_level", "off", SAME, checked_by=(*_T_IS, _T_IS_0110,)),
    _f("algo.advantage.is_correction_mode", "mask", SAME, checked_by=(*_T_IS, _T_IS_0110,)),
    _f("algo.advantage.is_correction_gating", "ratio", SAME, checked_by=(*_T_IS, _T_IS_0110,)),
    _f("algo.advantage.is_correction_threshold", [0.5, 5.0], SAME, checked_by=(*_T_IS, _T_IS_0110,)),
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
    _f("ckpt.save_steps", -1, OWN, why="-1 (OpenRLHF's off) is 0 here; every 20 steps by default, so a crashed run "
       "resumes from a recent checkpoint (a final checkpoint is always written)"),
    _f("ckpt.path", "./ckpt/checkpoints_ppo_ray", OWN, why="the checkpoints (with the optimizer state); unset: "
       "<ckpt.output_dir>/checkpoints, so one directory holds the whole run"),
    _f("ckpt.output_dir", "./ckpt", OWN, why="the run directory (metrics, checkpoints, HF export, train.log), "
       "named after the method"),
    _f("ckpt.save_hf", False, OWN, why="OpenRLHF always writes the final model to --ckpt.output_dir and the flag adds "
       "an HF copy beside every checkpoint; here the flag is that final export (<ckpt.output_dir>/hf), on by default "
       "so a run ends with its model as OpenRLHF's does; no per-checkpoint copies"),
    _f("ckpt.max_num", 3, SAME),
    _f("ckpt.load_enable", False, OWN, ours="ckpt.resume",
       why="resume from the newest complete checkpoint under --ckpt.path (--ckpt.resume auto); on by default here, so "
           "running the same command again continues a crashed run (--ckpt.resume none, or false, starts over)"),
    _f("ckpt.disable_ds", False, REFUSED, why="checkpoints always hold the optimizer state (exact resume); drop it"),
    _f("ckpt.max_mem", float("inf"), REFUSED, why="no size cap on checkpoints; use --ckpt.max_num"),
    _f("ckpt.best_metric_key", "", REFUSED, why="best-checkpoint selection is not implemented; use --ckpt.max_num and eval metrics"),
    _f("logger.logging_steps", 1, VALUES, accept={1: None}, why="metrics are logged every step"),
    _f("logger.wandb.key", None, REFUSED, why="give the key as the WANDB_API_KEY environment variable (a config is printed and saved)"),
    _f("logger.wandb.org", None, SAME),
    _f("logger.wandb.group", None, SAME),
    _f("logger.wandb.project", "openrlhf_train_ppo", OWN, why="W&B logging is on when a project is given (OpenRLHF: "
       "when --logger.wandb.key is; here the key is WANDB_API_KEY), so there is no default project"),
    _f("logger.wandb.run_name", "ppo_%m%dT%H:%M", OWN, why="unset: W&B names the run (OpenRLHF: ppo_ and the "
       "start time)"),
    _f("logger.tensorboard_dir", None, SAME),
    # ---- DeepSpeed and model-loading switches of the DeepSpeed actor
    _f("local_rank", -1, REFUSED, why="ranks are placed by Ray (no deepspeed launcher); drop it"),
    _f("ds.use_universal_ckpt", False, REFUSED, why="universal checkpoints are not written; resume a DeepSpeed checkpoint with the same --ds.zero_stage and rank count"),
    _f("ds.zero_stage", 2, SAME, why="ZeRO stage of --actor.backend deepspeed (0-3); given without --actor.backend it selects "
       "the DeepSpeed backend (OpenRLHF's); on Megatron shard with --megatron.use_distributed_optimizer"),
    _f("ds.deepcompile", False, REFUSED, why=f"{_DS}: the model runs eagerly; drop it"),
    _f("ds.param_dtype", "bf16", OWN, why="bf16 or fp32; unset (auto): bf16 on GPU as OpenRLHF, fp32 on CPU, which "
       "only emulates bf16 (slowly: said at start-up); fp16 is refused (no loss scaling); Megatron picks the same "
       "automatically (--megatron.bf16)"),
    _f("ds.zpg", 1, REFUSED, why=f"{_DS}: ZeRO++ hierarchical partitioning is not configured; drop it"),
    _f("ds.adam_offload", False, SAME, why="Adam states in host memory (DeepSpeedCPUAdam) with --actor.backend deepspeed; "
       "given without --actor.backend it selects the DeepSpeed backend"),
    _f("ds.attn_implementation", "flash_attention_2", OWN, why="the HF attention kernel of --actor.backend deepspeed; "
       "sdpa by default: it runs on CPU and GPU without the flash-attn package (which cannot build without CUDA); "
       "give flash_attention_2 where it is installed; Megatron picks its own"),
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
    _f("ds.value_head_prefix", "score", SAME, why="the value head's name (<prefix>.weight) of the reward model and the "
       "critic when their config.json names none (its value_head_prefix wins, as in OpenRLHF), on either backend; a "
       "saved critic writes its head under it; doctor checks the head there"),
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
    _f("train.num_episodes", 1, OWN, why="passes over the prompt set; given, it sets the number of steps before the "
       "run starts: episodes x (prompts // --rollout.batch_size), every step a full batch (a pass's tail shorter than "
       "a batch is skipped, where OpenRLHF trains it as a short last step). With --algo.dynamic_filtering_enable the "
       "refills take further prompts, so the run reads more passes than that (each prompt at most once per pass; said at "
       "start-up) and its LR schedule ends with its last step; OpenRLHF instead stops when the passes run out, before "
       "its LR schedule (sized for unfiltered passes) ends. Unset here: a run is sized by --train.num_steps (default "
       "360, the paper's runs)"),
    _f("rollout.batch_size", 1024, OWN, why="the paper's step: 128 prompts x 8 samples"),
    _f("train.batch_size", 128, OWN, why="the paper's mini-batch: 256 samples, 4 updates per step of 128 x 8"),
    _f("train.max_epochs", 1, SAME),
    _f("data.max_len", 2048, OWN, why="prompt + response tokens (given, it sets the response budget when "
       "--rollout.max_new_tokens is not); unset here: --data.max_prompt_len 1024 + --rollout.max_new_tokens 8192"),
    _f("rollout.max_new_tokens", None, OWN, why="the paper's response budget, 8192 tokens (OpenRLHF's unset: "
       "--data.max_len minus each prompt's length)"),
    _f("data.max_samples", 100000000, SAME),
    _f("rollout.n_samples_per_prompt", 1, OWN, why="the paper's 8 samples per prompt (group baselines and the "
       "step's statistics need several)"),
    _f("rollout.top_p", 1.0, SAME),
    _f("rollout.temperature", 1.0, SAME),
    _f("train.seed", 42, SAME),
    _f("train.full_determinism_enable", False, REFUSED,
       why="not implemented; runs are reproducible per step from --train.seed (resume redoes a step exactly)"),
    # ---- loss and optimizer
    _f("actor.eps_clip", 0.2, SAME, why="both ends of the clip range; --actor.eps_clip_low_high wins when given", checked_by=(*_T_LOSS,)),
    _f("actor.eps_clip_low_high", None, SAME, why="the clip range's two ends; DAPO's clip-higher 0.2 0.28 is the "
       "paper's, set in its presets", checked_by=(*_T_LOSS,)),
    _f("actor.dual_clip", None, SAME, checked_by=(*_T_LOSS,)),
    _f("actor.policy_loss_type", "ppo", SAME,
       why="ppo and gspo as OpenRLHF's PolicyLoss computes them; also cispo (MiniMax-M1's clipped importance weight, "
           "clip --actor.cispo_eps_clip_low_high), ours", checked_by=(*_T_LOSS,)),
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
    _f("actor.lr_scheduler", "cosine_with_min_lr", VALUES, accept={name: name for name in SCHEDULES},
       why="transformers' schedule of that name, as OpenRLHF builds it (warm-up from LR 0); the other transformers "
       "schedules are not built here", checked_by=(_T_LR,)),
    _f("actor.lr_warmup_ratio", 0.03, SAME, why="warm-up over ceil(ratio x the run's optimizer steps), from LR 0; "
       "constant does not read it (constant_with_warmup does); --actor.lr_warmup_steps (ours) wins when given",
       checked_by=(_T_LR,)),
    _f("actor.min_lr_ratio", 0.1, SAME, why="the floor, x --actor.adam.lr, of cosine_with_min_lr and "
       "cosine_warmup_with_min_lr (the others do not read it); --actor.min_lr (ours, absolute) wins when given",
       checked_by=(_T_LR,)),
    _f("actor.max_norm", 1.0, SAME),
    _f("algo.kl.init_coef", 0.01, OWN,
       why="0 here: no reference model, no KL (the paper's setting); > 0 starts the reference ranks",
       checked_by=(_D + "test_kl_in_the_reward_equals_openrlhfs_compute_reward", _T_KL_IN_REWARD, _T_KL_REWARD)),
    _f("algo.kl.use_loss", False, SAME, why="KL in the policy loss; without it -coef x kl per token in the reward", checked_by=(_D + "test_step_metrics_weight_updates_by_tokens_as_openrlhf",)),
    _f("algo.kl.estimator", "k1", SAME, why="k1 | k2 | k3 with OpenRLHF's clamping (openrlhf_shape/algorithms/kl.py)",
       checked_by=(_D + "test_kl_estimators_equal_openrlhfs", _T_KL,)),
    _f("algo.kl.unbiased_gradient", False, SAME, why="with --algo.kl.use_loss only", checked_by=(_D + "test_kl_estimators_equal_openrlhfs", _T_KL_UNBIASED,)),
    _f("algo.kl.target", None, SAME, why="the adaptive KL controller (unset: a fixed coefficient)",
       checked_by=(_D + "test_adaptive_controller_equals_openrlhfs", _T_KL_ADAPTIVE,)),
    _f("algo.kl.horizon", 10000, SAME, why="the adaptive KL controller's horizon in samples", checked_by=(_T_KL_ADAPTIVE,)),
    # ---- advantages
    _f("algo.advantage.estimator", "gae", OWN, ours="algo.advantage.estimator", accept=RegisteredEstimators(),
       why="shape, the paper's method; every registered estimator is accepted (OpenRLHF's with its semantics, "
           "docs/algorithms.md; " + ", ".join(f"{a} is {n}" for a, n in ESTIMATOR_ALIASES.items()) + " here); gae "
           "trains a critic beside the actor (--critic.*) and computes OpenRLHF's GAE on its values",
       checked_by=(_T_RETURNS, _T_KL_REWARD, _T_GAE)),
    _f("algo.advantage.gamma", 1, SAME,
       why="the return's per-token discount, for the estimators that discount returns (OpenRLHF's reinforce and gae); the others "
           "refuse a gamma other than 1, where OpenRLHF resets it to 1 with a warning; SHAPE's own discount is "
           "--shape.gamma_min",
       checked_by=(_T_RETURNS, _T_GAE)),
    _f("algo.advantage.lambd", 1, SAME, why="GAE's lambda, for --algo.advantage.estimator gae (refused with the "
       "others, which OpenRLHF ignores it for)", checked_by=(_T_GAE,)),
    _f("algo.advantage.no_std_norm", False, SAME,
       why="whitening without the std division, for the estimators that whiten (OpenRLHF's reinforce, "
           "reinforce_baseline and gae); refused with the others, which OpenRLHF ignores it for",
       checked_by=(_T_RETURNS, _T_GAE)),
    _f("algo.dynamic_filtering_enable", False, SAME,
       why="groups outside --algo.dynamic_filtering_range are dropped and new prompts sampled in their place until "
           "--rollout.batch_size groups pass, so every step trains a full batch; a short last mini-batch is dropped "
           "(drop_last) and the LR schedule counts the updates taken. Ours beside it: "
           "--algo.dynamic_filtering_max_rounds (default 32) bounds the refill rounds of a step and stops the run "
           "when the data cannot fill a batch"),
    _f("algo.dynamic_filtering_range", (0, 1), SAME, why="keep a prompt's group when its mean score lies strictly inside",
       checked_by=(_D + "test_dynamic_filter_keep_rule_equals_openrlhfs",)),
    # ---- rewards
    _f("reward.remote_url", None, SAME,
       why="a reward_func .py (called once per sample, as OpenRLHF) or HTTP server(s); it also judges SHAPE/MRT's "
           "probes (each as OpenRLHF's query: prompt + response prefix + forced-answer suffix + the probe; its rewards "
           "are the potential's terms, in [0, 1] as R; --probe.scorer math_verify keeps Math-Verify there) and the "
           "held-out eval"),
    _f("reward.clip_range", (-10, 10), SAME, why="the outcome estimators clamp their baselined outcome r_i into it (OpenRLHF's "
       "order); SHAPE and MRT clamp the outcome R as it comes, before it becomes the last potential",
       checked_by=(_T_RETURNS,)),
    _f("reward.normalize_enable", False, SAME, why=_RM_NORM),
    _f("reward.overlong_buffer_len", None, REFUSED, why="DAPO's overlong penalty is not implemented; drop it"),
    _f("reward.overlong_penalty_factor", 1, VALUES, accept={1: None, 1.0: None},
       why="DAPO's overlong penalty is not implemented"),
    _f("reward.stop_properly_penalty_coef", None, SAME,
       why="responses cut at --rollout.max_new_tokens (finish reason 'length'): reward x coef for coef in [0, 1], "
           "reward = coef for coef < 0; before --reward.clip_range and any baseline, as in OpenRLHF",
       checked_by=(_D + "test_stop_properly_penalty_equals_openrlhfs_apply_length_penalties", _T_STOP,)),
    _f("train.agent_func_path", None, SAME, why="OpenRLHF agent files run unchanged on the engines; the environment's replies get no loss and no credit (the Agents section of this page)",
       checked_by=(_T_AGENT,)),
    # ---- data and eval
    _f("actor.model_name_or_path", None, OWN, why="demo: the bundled SmolLM2-135M-Instruct, so a bare command trains "
       "(OpenRLHF requires the flag)"),
    _f("data.prompt_dataset", None, OWN, why="bundled:train: the bundled maths set, so a bare command trains "
       "(OpenRLHF requires the flag)"),
    _f("data.prompt_probs", None, REFUSED, why="one prompt set per run (no dataset mixing); merge the files first"),
    _f("data.prompt_split", "train", SAME),
    _f("data.input_key", "input", OWN, why="the bundled maths set's prompt field"),
    _f("data.label_key", None, OWN, why="the bundled maths set's answer field (Math-Verify needs a label)"),
    _f("data.input_template", None, SAME),
    _f("data.apply_chat_template", False, OWN, why="the demo model is an instruct model, and every OpenRLHF RL script "
       "passes the flag"),
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
    checked = sum(1 for f in OPENRLHF_PPO_FLAGS if f.checked_by)
    return (f"Of OpenRLHF 0.11.2's {len(OPENRLHF_PPO_FLAGS)} PPO flags, {c[SAME]} are honoured under the same name, "
            f"meaning and default, {c[OWN]} under the same name and meaning with a default of our own (each says "
            f"why), {c[ALWAYS]} switch on what is always on here (accepted, said once in the log), {c[VALUES]} are "
            f"accepted for the values that match what this trainer does, and {c[REFUSED]} are refused, each with "
            f"the reason and what to use; {checked} are machine-checked against OpenRLHF's own code.")


def show(value: Any) -> str:
    """A default as a user types it: ``unset``, ``true``/``false``, ``0.2 0.28``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(show(v) for v in value)
    return str(value)


def our_default(f: OpenRLHFFlag) -> Any:
    """Our default for the flag of row ``f`` (``KeyError`` for a row with no flag path of its own here)."""
    from openrlhf_shape.config.tree import TrainConfig  # lazily: the tree imports the components

    cfg = TrainConfig()
    if f.name == "data.max_len":  # combined: prompt + response tokens
        return cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    try:
        return cfg.get(f.ours or f.name)
    except AttributeError:
        raise KeyError(f.name) from None


def _checked(f: OpenRLHFFlag) -> str:
    if not f.checked_by:
        return ""
    return " Machine-checked against OpenRLHF's own code: " + ", ".join(f"`{t}`" for t in f.checked_by) + "."


def markdown_table() -> str:
    """The table of docs/openrlhf_compat.md: OpenRLHF flag -> ours."""
    lines = ["| OpenRLHF 0.11.2 flag | here |", "| --- | --- |"]
    for f in sorted(OPENRLHF_PPO_FLAGS, key=lambda f: f.name):
        if f.kind == SAME:
            target = f"`--{f.ours or f.name}`" + (f" ({f.why})" if f.why else "")
        elif f.kind == OWN:
            try:
                ours = f" `{show(our_default(f))}`"
            except KeyError:  # a combined flag: its why says what stands for it
                ours = ""
            target = f"`--{f.ours or f.name}`, our own default{ours} (OpenRLHF's `{show(f.default)}`): {f.why}"
        elif f.kind == ALWAYS:
            target = f"accepted, always on: {f.why}"
        elif f.kind == VALUES:
            ok = ", ".join(f"`{k}`" for k in f.accept if k is not None)
            target = f"`--{f.ours or f.name}` accepts {ok or 'the default only'}; else refused: {f.why}"
        else:
            target = f"refused: {f.why}"
        lines.append(f"| `--{f.name}` | {target}{_checked(f)} |")
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

