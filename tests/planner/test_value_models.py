"""Value models in the planner and the doctor (issue 50): the critic of ``--algo.advantage.estimator gae`` counted per
phase (its GPUs' memory: weights, grads and Adam state as the actor's, its forward's activations; its time beside the
actor's, or after it when they share GPUs; its ranks in host RAM on CPU), and the doctor's check that a critic's or
reward model's directory holds OpenRLHF's value head (``score.weight`` ``[1, hidden]``, config.json's
``value_head_prefix`` first), on checkpoints written here in that format.

A gae run is refused at load until the critic's rank group exists, so the configs here are built past that one
check (the flags applied to a loaded preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from openrlhf_shape.config import FLAGS, load_config
from openrlhf_shape.config.flags import parse_overrides
from openrlhf_shape.config.load import _resolved
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.memory import GiB
from openrlhf_shape.planner.plan import build_plan
from openrlhf_shape.planner.value_models import value_head_problem

REPO = Path(__file__).resolve().parents[2]


def _cfg(preset: str, flags: list[str], critic: list[str] | None = None):
    cfg = load_config(str(REPO / "configs" / preset), flags, check_paths=False)
    if critic is None:
        return cfg
    return FLAGS.build(cfg, _resolved(parse_overrides(["--algo.advantage.estimator", "gae", *critic])))


def _terms(ph) -> dict[str, int]:
    return {t.name: t.bytes for t in ph.terms}


def test_disaggregated_critic_has_its_own_gpus_and_runs_beside_the_actor():
    """qwen3-4b disaggregated (TP2 x DP4): a critic of as many ranks holds the actor's weights, grads and Adam state in
    its update (same formulas and layout) and no grads or optimizer in its values phase; its forward and update take
    the actor's seconds, run alongside, so the step waits 0 s more; on half the GPUs it waits as long again."""
    flags = ["--train.colocate_all", "false"]
    base = build_plan(_cfg("qwen3-4b.yaml", flags), PlanOptions())
    plan = build_plan(_cfg("qwen3-4b.yaml", flags, []), PlanOptions())
    assert base.critic is None and not base.critic_phases and plan.critic_world == plan.world == 8
    values, update = plan.critic_phases
    assert (values.name, update.name) == ("critic values (critic GPU)", "critic update (critic GPU)")
    actor = _terms(next(ph for ph in plan.gpu_phases if ph.name == "update"))
    for name in ("weights", "grads", "optimizer"):
        assert _terms(update)[f"critic {name}"] == actor[name] > 0, name
    assert not [t for t in values.terms if "grads" in t.name or "optimizer" in t.name]
    assert not [t for t in values.terms + update.terms if "log-prob" in t.name]  # a value head has no vocabulary
    ctx = int(plan.options.cuda_context_gib * GiB) + int(plan.options.nccl_gib * GiB)
    assert update.total == plan.critic.peak + ctx
    seconds = {p.name: p.seconds for p in plan.phases}
    assert seconds["critic values"] == seconds["critic update"] == 0.0
    half = build_plan(_cfg("qwen3-4b.yaml", flags, ["--critic.num_nodes", "1", "--critic.num_gpus_per_node", "4"]),
                      PlanOptions())
    seconds = {p.name: p.seconds for p in half.phases}
    assert seconds["critic values"] == pytest.approx(seconds["log-probs + entropy"], rel=1e-9)
    assert seconds["critic update"] == pytest.approx(seconds["update"], rel=1e-6)


def test_colocated_critic_runs_after_the_actor_and_says_what_is_not_modelled():
    plan = build_plan(_cfg("qwen3-4b.yaml", [], []), PlanOptions())
    seconds = {p.name: p.seconds for p in plan.phases}
    assert seconds["critic values"] == pytest.approx(seconds["log-probs + entropy"], rel=1e-9)
    assert [p.name for p in plan.phases].index("critic update") == [p.name for p in plan.phases].index("update") + 1
    assert any("critic: 8 rank(s) counted on GPUs of their own" in n for n in plan.notes)


def test_cpu_config_counts_the_critic_ranks_in_host_ram():
    base = build_plan(_cfg("cpu-smoke.yaml", []), PlanOptions())
    plan = build_plan(_cfg("cpu-smoke.yaml", [], []), PlanOptions())
    (ph,), (b,) = plan.gpu_phases, base.gpu_phases
    added = _terms(ph)
    n = plan.critic_world
    assert added[f"{n} critic rank(s) x critic optimizer"] > 0 and added[f"{n} critic rank(s) x critic grads"] > 0
    extra = sum(v for k, v in added.items() if "critic" in k)
    assert ph.total == b.total + extra


def _value_model(path: Path, *, head: tuple[int, int] | None, prefix: str = "score", config_prefix: str | None = None,
                 shards: int = 1, bin_file: bool = False) -> Path:
    """A tiny Qwen3 critic / reward model as OpenRLHF's get_llm_for_sequence_regression saves it: the base model under
    its ``base_model_prefix`` and a ``Linear(hidden, 1)`` value head named ``prefix``."""
    from transformers import AutoModel, Qwen3Config

    conf = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    if config_prefix:
        conf.value_head_prefix = config_prefix
    base = AutoModel.from_config(conf)
    state = {f"{base.base_model_prefix}.{k}": v.contiguous() for k, v in base.state_dict().items()}
    if head:
        state[f"{prefix}.weight"] = torch.zeros(head)
    path.mkdir(parents=True)
    conf.save_pretrained(path)
    if bin_file:
        torch.save(state, path / "pytorch_model.bin")
        return path
    names = sorted(state)
    files = {f"model-{i}.safetensors": names[i::shards] for i in range(shards)}
    for fname, keys in files.items():
        save_file({k: state[k] for k in keys}, str(path / fname))
    if shards == 1:
        (path / "model-0.safetensors").rename(path / "model.safetensors")
    else:
        index = {"weight_map": {k: f for f, keys in files.items() for k in keys}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_value_head_check_reads_openrlhfs_format(tmp_path):
    assert value_head_problem(str(_value_model(tmp_path / "ok", head=(1, 16)))) is None
    assert value_head_problem(str(_value_model(tmp_path / "sharded", head=(1, 16), shards=3))) is None
    assert value_head_problem(str(_value_model(tmp_path / "bin", head=(1, 16), bin_file=True))) is None
    named = _value_model(tmp_path / "named", head=(1, 16), prefix="value_head", config_prefix="value_head")
    assert value_head_problem(str(named)) is None  # config.json's value_head_prefix wins, as in OpenRLHF
    policy = value_head_problem(str(_value_model(tmp_path / "policy", head=None)))
    assert policy.endswith("no value head: no tensor score.weight (OpenRLHF's critic / reward-model format: the base "
                           "model and a Linear(hidden, 1) named score, --ds.value_head_prefix); a policy checkpoint is "
                           "not a value model")
    wrong = value_head_problem(str(_value_model(tmp_path / "wrong", head=(2, 16))))
    assert "score.weight has shape [2, 16], not [1, hidden_size] = [1, 16]" in wrong
    assert "not a Hugging Face model directory" in value_head_problem(str(tmp_path / "missing"))


def test_doctor_checks_the_critics_directory(tmp_path):
    from openrlhf_shape.cli.doctor import value_model_report

    good, bad = _value_model(tmp_path / "good", head=(1, 16)), _value_model(tmp_path / "bad", head=None)
    assert value_model_report(_cfg("cpu-smoke.yaml", [], ["--critic.model_name_or_path", str(good)])) == [
        ("critic.model_name_or_path", None)]
    ((flag, problem),) = value_model_report(_cfg("cpu-smoke.yaml", [], ["--critic.model_name_or_path", str(bad)]))
    assert flag == "critic.model_name_or_path" and "no value head" in problem
    assert value_model_report(_cfg("cpu-smoke.yaml", [], [])) == []  # from the actor's path: a fresh head
    assert value_model_report(_cfg("cpu-smoke.yaml", [])) == []  # no critic


def test_a_reward_models_forward_costs_what_the_critics_values_do():
    """A reward model is the critic's shape forward only: its time is the serial ``critic values`` phase's."""
    from openrlhf_shape.planner.model import ModelShape, resolve_model_config
    from openrlhf_shape.planner.value_models import critic_time, reward_model_time

    model, opt = ModelShape.from_file(resolve_model_config("demo", None)), PlanOptions()
    values, _ = critic_time(model, world=4, total_tokens=1e6, seq=2048, epochs=1, recompute=False, overlap=None, opt=opt)
    rm = reward_model_time(model, world=4, total_tokens=1e6, seq=2048, opt=opt)
    assert rm.name == "reward model" and values.seconds > 0 and rm.seconds == pytest.approx(values.seconds)


def _with_stats(path: Path, **stats) -> Path:
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, **stats}))
    return path


def test_doctor_reads_the_reward_models_head_under_the_flag_and_its_stats_under_normalisation(tmp_path):
    """--ds.value_head_prefix names the head when config.json does not (OpenRLHF's PPO critic save writes none);
    --reward.normalize_enable needs config.json's mean and a positive std (without them OpenRLHF divides by 0 / 1)."""
    from openrlhf_shape.cli.doctor import value_model_report

    rm = str(_value_model(tmp_path / "rm", head=(1, 16), prefix="value_head"))
    miss = value_head_problem(rm)
    assert "no tensor score.weight" in miss and "stored as value_head: set --ds.value_head_prefix to it" in miss
    flag = ["--reward.model_name_or_path", rm, "--ds.value_head_prefix", "value_head"]
    assert value_model_report(_cfg("cpu-smoke.yaml", flag)) == [("reward.model_name_or_path", None)]
    ((name, problem),) = value_model_report(_cfg("cpu-smoke.yaml", ["--reward.model_name_or_path", rm]))
    assert name == "reward.model_name_or_path" and "set --ds.value_head_prefix" in problem
    ((_, no_stats),) = value_model_report(_cfg("cpu-smoke.yaml", flag + ["--reward.normalize_enable"]))
    assert "--reward.normalize_enable normalises by config.json's reward mean / std, which it has not" in no_stats
    _with_stats(Path(rm), mean=0.5, std=0.0)
    ((_, zero_std),) = value_model_report(_cfg("cpu-smoke.yaml", flag + ["--reward.normalize_enable"]))
    assert "divides by config.json's std, which is 0.0" in zero_std
    _with_stats(Path(rm), mean=0.5, std=2.0)
    assert value_model_report(_cfg("cpu-smoke.yaml", flag + ["--reward.normalize_enable"])) == [
        ("reward.model_name_or_path", None)]
    named = str(_value_model(tmp_path / "named", head=None, config_prefix="value_head"))
    assert value_head_problem(named).endswith("named value_head, --ds.value_head_prefix); its config.json names the "
                                              "head value_head")
