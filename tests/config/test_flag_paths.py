"""Flag name = attribute path: every flag sets the attribute of its name, a saved config reads back, only
OpenRLHF's names are translated, and the backends train with ``actor.*``."""

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml

from openrlhf_shape.config import DERIVED, FLAGS, TrainConfig, config_from_dict, flag_view, load_config
from openrlhf_shape.actor.optim import OptimConfig, OptimSettings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _other_value(value, tp):
    """A value of the flag's type that differs from ``value`` (None: leave this flag out)."""
    if value is None:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return {int: 3, float: 0.5, str: "x", bool: True}.get(args[0] if args else tp)
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bool) or tp is bool:
        return not value
    if isinstance(value, tuple):
        return None
    if isinstance(value, int):
        return value + 1 if value >= 0 else 0
    if isinstance(value, float):
        return value * 0.5 if value else 0.5
    return None


# Flags whose sections refuse the generic other value (a string, a bound): a valid other value each.
_VALID_OTHER = {"actor.lr_scheduler": "constant", "actor.min_lr": 1e-7, "actor.dual_clip": 3.0,
                "megatron.layer_spec": "local", "megatron.local_attention": "sdpa", "megatron.routing_replay": "r2",
                "megatron.dist_optimizer_ckpt_format": "dp_reshardable", "ds.param_dtype": "bf16"}


def test_every_flag_sets_the_attribute_of_its_name():
    """For each numeric/boolean flag: ``--a.b.c V`` changes ``cfg.a.b.c`` to V and nothing else."""
    base = TrainConfig()
    base_view = flag_view(base)
    tried = 0
    for path, tp in FLAGS.types.items():
        if path in DERIVED:
            continue
        new = _VALID_OTHER.get(path, _other_value(base.get(path), tp))
        if new is None:
            continue
        try:
            cfg = FLAGS.build(base, dict(FLAGS.resolve(path, str(new))))
        except ValueError:
            continue  # a value its section refuses (e.g. a probability past 1): its own error test covers it
        assert cfg.get(path) == new, path
        changed = {k for k in _flat(flag_view(cfg)) if _flat(flag_view(cfg))[k] != _flat(base_view)[k]}
        assert changed == {path}, (path, changed)
        tried += 1
    assert tried > 80


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_backends_train_with_the_actor_settings():
    """``--actor.adam.*`` / ``--actor.eps_clip_low_high`` / ``--train.max_tokens_per_gpu`` reach what both the
    Megatron ranks and the DeepSpeed ranks are handed."""
    flags = ["--actor.adam.lr", "3e-6", "--actor.adam.betas", "0.9", "0.95", "--actor.eps_clip_low_high", "0.1", "0.3",
             "--train.max_tokens_per_gpu", "4096", "--actor.min_lr_ratio", "0.1", "--actor.max_norm", "0.5",
             "--actor.pack_samples", "false"]
    for backend in ("megatron", "deepspeed"):
        cfg = load_config(None, flags + ["--actor.backend", backend])
        rank = (cfg.megatron_config() if backend == "megatron" else cfg.zero_config()).optim
        assert (rank.adam.lr, *rank.adam.betas) == (3e-6, 0.9, 0.95)
        assert (*rank.eps_clip_low_high, rank.micro_batch_max_tokens) == (0.1, 0.3, 4096)
        assert rank.min_lr_rate == 0.1 and rank.max_norm == 0.5 and rank.pack_samples is False
        assert rank.total_steps == cfg.total_optimizer_steps() and rank.seed == cfg.train.seed
        for f in dataclasses.fields(OptimSettings):  # the ranks' settings are the actor section's, by name
            assert getattr(rank, f.name) == getattr(cfg.actor, f.name), f.name
    neutral = {f.name for f in dataclasses.fields(OptimConfig)} | {f"adam.{f}" for f in ("lr", "betas", "eps", "weight_decay")}
    for section in ("megatron", "ds"):  # one flag per setting: no backend section repeats a backend-neutral one
        assert not {f"{section}.{name}" for name in neutral} & set(FLAGS.types), section


def test_rank_errors_name_the_flag_users_type():
    with pytest.raises(ValueError, match=r"^--actor\.adam\.lr must be > 0"):
        load_config(None, ["--actor.adam.lr", "0"])
    with pytest.raises(ValueError, match=r"--actor\.adam\.betas must be in \[0, 1\)"):
        load_config(None, ["--actor.adam.betas", "0.9", "1.5"])
    with pytest.raises(ValueError, match=r"--megatron\.sequence_parallel"):
        load_config(None, ["--megatron.sequence_parallel", "true"])
    with pytest.raises(ValueError, match=r"--rollout\.n_samples_per_prompt must be >= 1"):
        load_config(None, ["--rollout.n_samples_per_prompt", "0", "--algo.advantage.estimator", "mrt"])


def test_probe_count_is_owned_by_the_probe_section_and_checked_once():
    cfg = load_config(None, ["--probe.num_probes", "4", "--probe.max_tokens", "8"])
    assert (cfg.probe.num_probes, cfg.probe.max_tokens) == (4, 8)
    assert cfg.max_model_len() == 1024 + 8192 + 64 + 8
    with pytest.raises(ValueError, match=r"--shape\.gamma_min: 0\.9 <= .* m = 16 probes \(--probe\.num_probes\)"):
        load_config(None, ["--probe.num_probes", "16"])
    load_config(None, ["--probe.num_probes", "16", "--algo.advantage.estimator", "mrt"])  # MRT has no gamma
    load_config(None, ["--probe.num_probes", "16", "--shape.gamma_min", "0.95"])


def test_estimator_flag_is_the_one_source_of_the_algorithms_estimator():
    """One field holds the estimator's name (``--algo.advantage.estimator``); ``--shape.*`` holds its settings
    (no copy of the name), and the paper's bounds are checked for the estimator that field names."""
    cfg = load_config(None, ["--algo.advantage.estimator", "group_norm", "--shape.alpha", "0.6"])  # OpenRLHF's name
    assert cfg.algo.advantage.estimator == "grpo" and cfg.shape.alpha == 0.6  # grpo ignores alpha's bound
    assert "estimator" not in cfg.to_dict()["shape"] and "shape.estimator" not in FLAGS.types
    for estimator in ("shape", "mrt"):
        with pytest.raises(ValueError, match=r"--shape\.alpha: alpha=0\.6 >= 0\.5 .* A\.1"):
            load_config(None, ["--algo.advantage.estimator", estimator, "--shape.alpha", "0.6"])


def test_derived_fields_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--vllm.model_path is derived .* use --actor.model_name_or_path"):
        FLAGS.resolve("vllm.model_path", "/m")


def test_print_config_is_a_preset_of_current_names(tmp_path, capsys):
    """``--print_config`` prints flag paths only; fed back as a preset it gives the same config, silently."""
    cfg = load_config(str(ROOT / "configs" / "cpu-smoke.yaml"), ["--actor.adam.lr", "4e-6"])
    capsys.readouterr()
    dumped = tmp_path / "printed.yaml"
    dumped.write_text(yaml.safe_dump(flag_view(cfg), sort_keys=False))
    again = load_config(str(dumped))
    assert "[deprecated]" not in capsys.readouterr().err
    assert flag_view(again) == flag_view(cfg) and again.megatron_config() == cfg.megatron_config()


def test_saved_config_reads_back():
    """``run.json``'s ``config`` (``to_dict()``) reads back into the same tree, derived fields included."""
    cfg = load_config(str(ROOT / "configs" / "cpu-smoke.yaml"), [
        "--eval.top_p", "0.9", "--actor.adam.betas", "0.9", "0.98", "--probe.num_probes", "2",
        "--algo.advantage.estimator", "mrt", "--algo.advantage.is_correction_level", "token"], check_paths=False)
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict() and again.algo.advantage.estimator == "mrt"
    assert again.megatron_config() == cfg.megatron_config()


def test_only_openrlhf_names_are_translated():
    """Compatibility is for names an OpenRLHF user types: this project's earlier names (never in a release) are
    unknown options, and ``translate`` passes every name that is not OpenRLHF's through untouched."""
    from openrlhf_shape.config import compat
    from openrlhf_shape.config.openrlhf import BY_NAME

    earlier = ["trainer.num_steps", "sampling.n", "engine.block_size", "megatron.lr", "actor.pretrain",
               "rollout.rollout_batch_size", "shape.num_probes", "data.prompt_data"]
    assert not set(earlier) & set(BY_NAME)
    assert compat.translate([(name, "4") for name in earlier]) == [(name, "4") for name in earlier]
    for name in earlier:
        with pytest.raises(ValueError, match=rf"unknown option --{name}\b"):
            load_config(None, [f"--{name}", "4"])
