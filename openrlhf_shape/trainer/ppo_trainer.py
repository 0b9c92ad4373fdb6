"""The PPO loop: Ray placement, generate -> SHAPE experience -> mini-batch updates -> weight sync
-> periodic eval and checkpoint. One code path for CPU and GPU.

Per step (DESIGN.md section 2): the experience maker produces rollouts, rewards, old log-probs and
entropy, segments, probes and advantages; the rollout batch is cut into mini-batches of
``actor.train_batch_size`` samples, each one optimizer step on the Megatron ranks (loss normalised
by the mini-batch's global valid-token count); then the new weights stream to the vLLM engines.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from typing import Any

import torch

from openrlhf_shape.trainer.config import TrainConfig
from openrlhf_shape.trainer.logging_utils import MetricsLogger, log, setup_console_logging

# Import-time notices that every Megatron/vLLM worker prints and that say nothing about the run.
QUIET_WARNINGS = ",".join(
    f"ignore:{m}"
    for m in ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated",
              "`torch.jit.script_method` is deprecated", "`torch.distributed.reduce_op` is deprecated")
)

PHASES = ("generate", "rewards", "logprobs", "segment", "probes", "advantages", "train", "sync", "eval", "checkpoint")


def megatron_config_from(cfg: TrainConfig):
    """The one place that maps training flags to the actor's :class:`MegatronConfig`."""
    from openrlhf_shape.megatron.config import MegatronConfig

    a, m = cfg.actor, cfg.megatron
    steps_per_rollout = max(1, (cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt) // a.train_batch_size)
    return MegatronConfig(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        use_distributed_optimizer=m.use_distributed_optimizer,
        recompute_activations=m.recompute_activations,
        lr=a.learning_rate,
        min_lr=a.min_lr,
        lr_warmup_fraction=a.lr_warmup_ratio,
        lr_decay_style=a.lr_decay_style,
        total_steps=max(1, cfg.trainer.num_steps * steps_per_rollout * a.max_epochs),
        weight_decay=a.weight_decay,
        clip_grad=a.max_norm,
        seed=cfg.trainer.seed,
        micro_batch_max_tokens=a.micro_batch_max_tokens,
        eps_clip_low=a.eps_clip_low_high[0],
        eps_clip_high=a.eps_clip_low_high[1],
        dual_clip=a.dual_clip,
        entropy_chunk_size=a.entropy_chunk_size,
    )


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


def _mean_metrics(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = float(sum(vals) / len(vals))
    return out


class ShapeTrainer:
    """Builds every component from a :class:`TrainConfig` and runs the loop (``fit``)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.trainer.output_dir)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self.engines = None
        self.engine_handles: list = []
        self.actor = None
        self.reward = None

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        import ray
        from transformers import AutoConfig, AutoTokenizer

        from openrlhf_shape.data.prompts import PromptBatcher, PromptDataConfig, build_prompt_dataset
        from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
        from openrlhf_shape.rollout.engine import EngineConfig, EngineGroup, create_ray_engines
        from openrlhf_shape.trainer.actor_group import MegatronActorGroup
        from openrlhf_shape.trainer.experience import ExperienceConfig, ShapeExperienceMaker

        cfg = self.cfg
        t0 = time.perf_counter()
        self.model_dir = resolve_model_dir(cfg.actor.pretrain)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        mcfg = megatron_config_from(cfg)
        mcfg.validate_against_model(hf_config, cfg.megatron.world_size)  # heads % TP, layers % PP, ...
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        data_cfg = PromptDataConfig(
            prompt_dataset=_prompt_source(cfg.data.prompt_data),
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            apply_chat_template=cfg.data.apply_chat_template,
            input_template=cfg.data.input_template,
            system_prompt=cfg.data.system_prompt,
            max_prompt_len=cfg.data.max_prompt_len,
            max_samples=cfg.data.max_samples,
        )
        self.dataset = build_prompt_dataset(data_cfg, self.tokenizer)
        if len(self.dataset) < cfg.rollout.rollout_batch_size:
            raise ValueError(
                f"--rollout.rollout_batch_size {cfg.rollout.rollout_batch_size} exceeds the {len(self.dataset)} "
                f"usable prompts of {cfg.data.prompt_data} ({self.dataset.num_filtered} filtered by "
                f"--data.max_prompt_len {cfg.data.max_prompt_len})"
            )
        log.info("prompts: %d usable, %d filtered as longer than %d tokens", len(self.dataset),
                 self.dataset.num_filtered, cfg.data.max_prompt_len)
        self.batcher = PromptBatcher(self.dataset, cfg.rollout.rollout_batch_size, seed=cfg.trainer.seed)
        self.eval_items = None
        if cfg.data.eval_data:
            eval_cfg = PromptDataConfig(**{**asdict(data_cfg), "prompt_dataset": _prompt_source(cfg.data.eval_data),
                                           "max_samples": cfg.data.eval_max_samples})
            self.eval_items = list(build_prompt_dataset(eval_cfg, self.tokenizer))

        on_gpu = torch.cuda.is_available()
        if not ray.is_initialized():
            if cfg.trainer.ray_address:
                ray.init(address=cfg.trainer.ray_address, log_to_driver=True)
            else:
                ray.init(include_dashboard=False, log_to_driver=True,
                         runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": QUIET_WARNINGS}})
        self._own_ray = not cfg.trainer.ray_address
        gpus_rank = cfg.megatron.gpus_per_rank if on_gpu else 0.0
        gpus_engine = None if on_gpu else 0.0
        if on_gpu and cfg.rollout.colocate:  # share each GPU between a rank and an engine
            gpus_rank, gpus_engine = 0.5, 0.5
        engine_cfg = EngineConfig(
            model_path=self.model_dir,
            seed=cfg.trainer.seed,
            tensor_parallel_size=cfg.rollout.engine_tensor_parallel_size,
            block_size=cfg.rollout.block_size,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_model_len=cfg.max_model_len(),
            enable_sleep_mode=bool(on_gpu and cfg.rollout.colocate),
            dtype=("float32" if not on_gpu else "auto") if cfg.rollout.dtype == "auto" else cfg.rollout.dtype,
        )
        log.info("starting %d vLLM engine(s) and %d Megatron rank(s) (TP %d, PP %d, DP %d)",
                 cfg.rollout.num_engines, cfg.megatron.world_size, mcfg.tensor_model_parallel_size,
                 mcfg.pipeline_model_parallel_size, mcfg.data_parallel_size(cfg.megatron.world_size))
        # Both start concurrently: engine start-up and Megatron start-up overlap.
        threads = None if on_gpu else max(1, (os.cpu_count() or 1) // cfg.megatron.world_size)
        self.actor = MegatronActorGroup(mcfg, cfg.megatron.world_size, num_cpus_per_rank=cfg.actor.num_cpus_per_rank,
                                        num_gpus_per_rank=gpus_rank, num_threads_per_rank=threads)
        self.engine_handles = create_ray_engines(cfg.rollout.num_engines, engine_cfg,
                                                 num_cpus_per_engine=cfg.rollout.num_cpus_per_engine,
                                                 num_gpus_per_engine=gpus_engine)
        self.engines = EngineGroup(self.engine_handles)
        info = self.actor.init_model(self.model_dir)
        log.info("actor: %s", info)
        self.reward = RewardComputer(RewardConfig(remote_url=cfg.reward.remote_url, num_workers=cfg.reward.num_workers,
                                                  fast_probe_scoring=cfg.reward.fast_probe_scoring,
                                                  timeout_s=cfg.reward.timeout_s, max_chars=cfg.reward.max_chars))
        exp_cfg = ExperienceConfig(
            shape=cfg.shape,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            dynamic_filtering=cfg.rollout.dynamic_filtering,
            probe_temperature=cfg.probe.temperature,
            probe_top_p=cfg.probe.top_p,
            think_suffix=cfg.probe.think_suffix,
            answer_suffix=cfg.probe.answer_suffix,
            probe_adaptive=cfg.probe.adaptive,
            probe_adaptive_tol=cfg.probe.adaptive_tol,
            probe_max_probes=cfg.probe.max_probes,
            probe_adaptive_first_round=cfg.probe.adaptive_first_round,
            probe_adaptive_round_size=cfg.probe.adaptive_round_size,
        )
        self.maker = ShapeExperienceMaker(exp_cfg, self.engines, self.actor, self.reward, self.tokenizer)
        self.setup_seconds = time.perf_counter() - t0
        log.info("set-up done in %.1f s", self.setup_seconds)

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int:
        from openrlhf_shape.megatron.checkpoint import latest_checkpoint

        mode = self.cfg.trainer.resume
        path = None
        if mode == "auto":
            path = latest_checkpoint(self.ckpt_root)
        elif mode != "none":
            path = mode
        if not path:
            if mode == "auto":
                log.info("no complete checkpoint under %s: starting from step 0", self.ckpt_root)
            return 0
        extra = self.actor.load_checkpoint(path)
        self.batcher.load_state_dict(extra["batcher"])
        step = int(extra["step"])
        log.info("resumed from %s at step %d (data epoch %d, position %d)", path, step,
                 self.batcher.epoch, self.batcher.position)
        self.actor.push_weights(self.engine_handles, self.cfg.rollout.weight_sync_bucket_mb << 20)
        return step

    def _save(self, step: int) -> str:
        path = os.path.join(self.ckpt_root, f"step_{step:06d}")
        extra = {"step": step, "batcher": self.batcher.state_dict(), "time": time.time()}
        self.actor.save_checkpoint(path, extra)
        # keep the newest max_ckpts_keep complete checkpoints
        done = sorted(d for d in os.listdir(self.ckpt_root) if d.startswith("step_") and "." not in d)
        for old in done[: -self.cfg.trainer.max_ckpts_keep]:
            shutil.rmtree(os.path.join(self.ckpt_root, old), ignore_errors=True)
        return path

    # ------------------------------------------------------------------ one step
    def train_on(self, exp, step: int) -> dict[str, float]:
        cfg = self.cfg
        n = len(exp)
        mb = min(cfg.actor.train_batch_size, n)
        gen = torch.Generator().manual_seed(cfg.trainer.seed * 100003 + step)
        rows = []
        for _epoch in range(cfg.actor.max_epochs):
            order = torch.randperm(n, generator=gen).tolist()
            for start in range(0, n, mb):  # a short last mini-batch (after DAPO filtering) still trains
                rows.append(self.actor.train_step(exp.as_train_batch(order[start : start + mb], cfg.rollout.temperature)))
        out = {f"actor/{k}": v for k, v in _mean_metrics(rows).items()}
        out["actor/updates"] = float(len(rows))
        out["actor/skipped_updates"] = float(sum(r.get("skipped", 0.0) for r in rows))
        return out

    def evaluate(self) -> dict[str, float]:
        from openrlhf_shape.rollout.engine import SamplingConfig

        items = self.eval_items or []
        if not items:
            return {}
        gens = self.engines.generate([list(it.prompt_ids) for it in items],
                                     SamplingConfig(n=1, temperature=0.0, max_tokens=self.cfg.rollout.max_new_tokens))
        scores = self.reward.score([g.text for g in gens], [items[g.prompt_index].label for g in gens])
        return {
            "eval/accuracy": float(sum(scores) / len(scores)),
            "eval/response_length/mean": float(sum(len(g.token_ids) for g in gens) / len(gens)),
        }

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        start_step = self._resume()
        run_info = {"estimator": cfg.shape.estimator, "name": os.path.basename(self.run_dir),
                    "model": self.model_dir, "config": cfg.to_dict()}
        logger = MetricsLogger(self.run_dir, run_info, cfg.trainer.use_tensorboard, cfg.trainer.wandb_project,
                               resume_step=start_step if start_step > 0 else None)
        last = min(cfg.trainer.num_steps, start_step + (cfg.trainer.stop_after_steps or cfg.trainer.num_steps))
        history: list[dict] = []
        bar = tqdm(range(start_step + 1, last + 1), desc=f"{cfg.shape.estimator} steps", initial=start_step,
                   total=cfg.trainer.num_steps, dynamic_ncols=True)
        try:
            for step in bar:
                t_step = time.perf_counter()
                items = self.batcher.next_batch()
                # Sampling depends only on (seed, step, weights, prompts): a resumed run redoes a step exactly.
                self.engines.reseed(cfg.trainer.seed * 1_000_003 + step)
                exp = self.maker.make_experience(items)
                metrics = dict(exp.metrics)
                if len(exp) == 0:
                    log.warning("step %d: every group was filtered (no reward variance); no update", step)
                    metrics["actor/updates"] = 0.0
                else:
                    t0 = time.perf_counter()
                    metrics.update(self.train_on(exp, step))
                    metrics["time/train"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    if cfg.rollout.colocate:
                        self.engines.wake_up()
                    metrics.update(self.actor.push_weights(self.engine_handles, cfg.rollout.weight_sync_bucket_mb << 20))
                    metrics["time/sync"] = time.perf_counter() - t0
                if cfg.trainer.eval_steps and step % cfg.trainer.eval_steps == 0:
                    t0 = time.perf_counter()
                    metrics.update(self.evaluate())
                    metrics["time/eval"] = time.perf_counter() - t0
                if (cfg.trainer.save_steps and step % cfg.trainer.save_steps == 0) or step == cfg.trainer.num_steps:
                    t0 = time.perf_counter()
                    metrics["checkpoint"] = self._save(step)
                    metrics["time/checkpoint"] = time.perf_counter() - t0
                metrics["time/step"] = time.perf_counter() - t_step
                metrics["data/epoch"] = float(self.batcher.epoch)
                logger.log(step, metrics)
                history.append({"step": step, **metrics})
                bar.set_postfix(acc=f"{metrics['rollout/accuracy']:.3f}",
                                len=f"{metrics['rollout/response_length/mean']:.0f}",
                                t=f"{metrics['time/step']:.0f}s")
                log.info(
                    "step %d/%d: acc %.3f, len %.0f, segments %.2f, drop rate %.2f, loss %s, step %.1f s (%s)",
                    step, cfg.trainer.num_steps, metrics["rollout/accuracy"], metrics["rollout/response_length/mean"],
                    metrics.get("shape/segments_per_response/mean", float("nan")),
                    metrics.get("shape/potential_drop_rate", float("nan")),
                    f"{metrics['actor/loss']:.4f}" if "actor/loss" in metrics else "-",
                    metrics["time/step"],
                    ", ".join(f"{p} {metrics['time/' + p]:.1f}s" for p in PHASES if f"time/{p}" in metrics),
                )
                for s in exp.samples[: cfg.trainer.log_samples]:
                    log.info("  sample (R=%.0f, label %s): %s", s["reward"], s["label"], s["response"][-300:].replace("\n", " "))
        finally:
            bar.close()
            logger.close()
        if cfg.trainer.export_hf and history and history[-1]["step"] == cfg.trainer.num_steps:
            hf_out = os.path.join(self.run_dir, "hf")
            self.actor.export_hf(hf_out)
            log.info("exported the trained policy to %s", hf_out)
        summary = write_report(self.run_dir, history, self.setup_seconds)
        return summary

    def shutdown(self) -> None:
        import ray

        if self.reward is not None:
            self.reward.close()
        if self.engines is not None:
            self.engines.shutdown()
        if self.actor is not None:
            self.actor.shutdown()
        if ray.is_initialized() and getattr(self, "_own_ray", True):
            ray.shutdown()


def write_report(run_dir: str, history: list[dict], setup_seconds: float) -> dict[str, Any]:
    """A short markdown report of this invocation (steps run, per-phase time split, accuracy)."""
    if not history:
        return {}
    phase_tot = {p: sum(h.get(f"time/{p}", 0.0) for h in history) for p in PHASES}
    step_tot = sum(h["time/step"] for h in history)
    summary = {
        "steps": [h["step"] for h in history],
        "setup_seconds": setup_seconds,
        "step_seconds_total": step_tot,
        "phase_seconds": phase_tot,
        "accuracy": [h.get("rollout/accuracy") for h in history],
        "response_length": [h.get("rollout/response_length/mean") for h in history],
    }
    lines = [
        f"# Run report: {os.path.basename(run_dir)}",
        "",
        f"Steps {history[0]['step']}..{history[-1]['step']}, set-up {setup_seconds:.1f} s, steps {step_tot:.1f} s.",
        "",
        "| phase | seconds | share |",
        "| --- | ---: | ---: |",
    ]
    for p, v in phase_tot.items():
        if v > 0:
            lines.append(f"| {p} | {v:.1f} | {100 * v / max(step_tot, 1e-9):.1f}% |")
    lines += ["", "| step | accuracy | mean length | segments | drop rate | loss | held-out accuracy |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for h in history:
        held_out = f"{h['eval/accuracy']:.3f}" if "eval/accuracy" in h else ""
        lines.append(
            f"| {h['step']} | {h.get('rollout/accuracy', float('nan')):.3f} | {h.get('rollout/response_length/mean', 0):.0f} | "
            f"{h.get('shape/segments_per_response/mean', float('nan')):.2f} | {h.get('shape/potential_drop_rate', float('nan')):.2f} | "
            f"{h.get('actor/loss', float('nan')):.4f} | {held_out} |"
        )
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    setup_console_logging()
    trainer = ShapeTrainer(cfg)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        trainer.shutdown()
