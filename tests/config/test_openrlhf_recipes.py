"""OpenRLHF's own RL launch scripts through our flag check (issue 35).

The five scripts' flags are data in ``openrlhf_recipes/*.txt`` (README there: source commit, what was changed).
Each list is first parsed by the installed OpenRLHF 0.11.2's own parser (so every name and value is 0.11.2's),
then by ``load_config``. Refused before issue 35 (main at 814b8d9): dapo 7, prorlv2_math 9, reinforce_baseline 12,
reinforce_baseline_agent_async 13, ppo 12. Refused now: dapo 0, prorlv2_math 0, reinforce_baseline 2,
reinforce_baseline_agent_async 3 (the "Long reasoning" flags of issue 36, ``LONG``) and ppo 0 (its reward
model's flags taken since issue 50's reward-model group; its 3 critic flags since its GAE, ``PPO_CRITIC``), each
with its reason. ``PENDING`` lists flags other issue-35 work still owns (none).
"""

from __future__ import annotations

import logging
import os
import shlex

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.config.compat import FlagError
from openrlhf_shape.config.flags import parse_overrides
from openrlhf_shape.config.openrlhf import refusal
from test_openrlhf_flag_table import _openrlhf_parser

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = ("dapo", "prorlv2_math", "reinforce_baseline", "reinforce_baseline_agent_async", "ppo")

# flag -> the issue-35 branch that owns it, while that work has not landed: empty now (the reference model and KL
# came with i3x-kl, the estimators with i3x-est, agents with i3x-agent)
PENDING: dict[str, str] = {}
LONG: set[str] = set()  # issue 36's flags: packing, ring attention and partial rollouts are all honoured now
PPO_PARTS: dict[str, str] = {  # flag -> the part its refusal names: none left (issue 50 took the reward
}  # model's four flags and the critic's)
# What stays refused once the pending work has landed, per script.
FINAL = {
    "dapo": set(),
    "prorlv2_math": set(),
    "reinforce_baseline": set(),
    "reinforce_baseline_agent_async": set(),
    "ppo": set(PPO_PARTS),
}
PPO_CRITIC = {"critic.num_nodes", "critic.num_gpus_per_node", "critic.adam.lr"}  # taken; the run is refused for gae
BEFORE = {"dapo": 7, "prorlv2_math": 9, "reinforce_baseline": 12, "reinforce_baseline_agent_async": 13, "ppo": 12}


def recipe(name: str) -> list[str]:
    """The script's command line (argv tokens) from its flag list."""
    argv: list[str] = []
    with open(os.path.join(HERE, "openrlhf_recipes", f"{name}.txt")) as f:
        for line in f:
            argv += shlex.split(line.split("#", 1)[0])
    return argv


def refused(argv: list[str]) -> dict[str, str]:
    """flag -> its refusal line, for every flag of ``argv`` our flag check refuses."""
    return {n: msg for n, v in parse_overrides(argv) if (msg := refusal(n, v))}


def without(argv: list[str], names: set[str]) -> list[str]:
    out, skip = [], False
    for tok in argv:
        if tok.startswith("--"):
            skip = tok[2:] in names
        if not skip:
            out.append(tok)
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_openrlhf_0_11_2s_command_line(name):
    """Every flag and value of the list is one OpenRLHF 0.11.2's own parser takes (no renamed or dropped flag)."""
    args = _openrlhf_parser().parse_args(recipe(name))
    assert args is not None
    assert len(parse_overrides(recipe(name))) > BEFORE[name]


@pytest.mark.parametrize("name", RECIPES)
def test_only_other_work_long_reasoning_and_the_ppo_critic_are_refused(name):
    lines = refused(recipe(name))
    pending = {n for n in lines if n in PENDING}
    assert set(lines) - pending == FINAL[name], sorted(lines)
    for flag in FINAL[name] & LONG:
        assert '"Long reasoning" work (issue 36)' in lines[flag], lines[flag]
    for flag in FINAL[name] & set(PPO_PARTS):
        assert PPO_PARTS[flag] in lines[flag], lines[flag]
    print(f"{name}: refused before {BEFORE[name]}, now {len(lines)} "
          f"({len(lines) - len(pending)} for good reasons + {len(pending)} pending: "
          + ", ".join(f"{n} ({PENDING[n]})" for n in sorted(pending)) + ")")


# two flags refused for good (no recipe refuses any since issue 50), so that the one error has lines to name
REFUSED_EXTRA = ["--ckpt.disable_ds", "--actor.muon.lr", "0.02"]


@pytest.mark.parametrize("name", RECIPES)
def test_one_error_names_every_refused_flag_one_line_each(name):
    argv = recipe(name) + REFUSED_EXTRA
    with pytest.raises(FlagError) as err:
        load_config(None, argv)
    lines = str(err.value).splitlines()[1:]
    assert sorted(ln.strip().split(":")[0].split()[0][2:] for ln in lines) == sorted(refused(argv))
    assert set(refused(argv)) == FINAL[name] | {"ckpt.disable_ds", "actor.muon.lr"}


@pytest.mark.parametrize("name", ["dapo", "prorlv2_math"])
def test_scripts_refused_nothing_load_whole(name):
    """dapo and prorlv2_math: the whole command line (paths changed only) loads and validates, the reference model
    and the KL in the loss as the script asks (its 8 reference ranks on the actor's 8 GPUs)."""
    argv = recipe(name)
    assert not refused(argv)
    cfg = load_config(None, argv)
    assert cfg.ref.num_nodes * cfg.ref.num_gpus_per_node == cfg.actor.world_size == 8 and cfg.train.colocate_all
    kl = cfg.kl_penalty()
    assert kl.in_loss and kl.estimator == {"dapo": "k3", "prorlv2_math": "k2"}[name]
    assert cfg.kl_controller().value == pytest.approx({"dapo": 1e-3, "prorlv2_math": 1e-4}[name])


def test_the_four_critic_free_scripts_are_refused_nothing():
    """Issue 35's done-means (and issue 36's flags since "Long reasoning" landed): the four critic-free scripts pass
    the flag check whole."""
    for name in ("dapo", "prorlv2_math", "reinforce_baseline", "reinforce_baseline_agent_async"):
        assert not refused(recipe(name)), name


# The scripts' agent file is OpenRLHF's examples/python/agent_func.py (not shipped with the package): a path
# changed like the model's, to our agent of the same interface.
AGENT_FILE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "rollout", "agent_files", "calculator_agent.py")


def _rest(name: str):
    argv = [AGENT_FILE if a == "examples/python/agent_func.py" else a for a in recipe(name)]
    return load_config(None, without(argv, set(PENDING) | LONG | set(PPO_PARTS) | PPO_CRITIC))


@pytest.mark.parametrize("name", RECIPES)
def test_the_rest_of_the_script_passes_the_whole_check(name):
    """Without the refused flags the script's command line resolves and validates (layout, batches, backend)."""
    cfg = _rest(name)
    assert cfg.actor.backend == "deepspeed" and cfg.ds.zero_stage == 3  # --ds.zero_stage: OpenRLHF's backend
    assert cfg.actor.model_name_or_path == "demo" and cfg.actor.gradient_checkpointing_enable
    assert cfg.algo.advantage.is_correction_level == "token"
    assert cfg.train.colocate_all is (name != "reinforce_baseline_agent_async")


def test_what_the_honoured_flags_set():
    pro, rb, agent = _rest("prorlv2_math"), _rest("reinforce_baseline"), _rest("reinforce_baseline_agent_async")
    assert pro.reward.stop_properly_penalty_coef == 0.0 and pro.rollout.max_tokens_per_gpu is None
    assert pro.optim_config().forward_budget == pro.train.max_tokens_per_gpu == 32768  # OpenRLHF's default rule
    assert rb.rollout.max_tokens_per_gpu == 32768 and rb.train.max_tokens_per_gpu == 16192
    assert rb.optim_config().forward_budget == 32768 and rb.optim_config().micro_batch_max_tokens == 16192
    assert rb.zero_config().optim.forward_budget == 32768 and rb.megatron_config().optim.forward_budget == 32768
    # async with colocate_all: OpenRLHF colocates only the training models, the engines get their own GPUs
    assert agent.train.async_enable and not agent.train.colocate_all
    # partial rollouts: cut at a quarter of the 64000-token budget unless --rollout.partial_chunk_tokens says; with
    # the script's agent nothing is cut (episodes run whole inside a window)
    assert agent.train.partial_rollout_enable and agent.rollout.partial_chunk() == 16000
    assert agent.partial_chunk_in_effect() == 0
    # ring attention (context parallelism) on the DeepSpeed backend, OpenRLHF's flags
    for c in (rb, agent):
        assert (c.zero_config().ring_attn_size, c.zero_config().ring_attn_head_stride) == (2, 2)
    # the reference model and KL as each script asks: KL in the loss (k2) for the REINFORCE++-baseline scripts,
    # OpenRLHF's default (k1 in the reward) for PPO; the agent's reference ranks on GPUs of their own (async)
    for cfg in (rb, agent):
        kl = cfg.kl_penalty()
        assert kl.in_loss and kl.estimator == "k2" and cfg.kl_controller().value == pytest.approx(1e-5)
        assert cfg.ref.world_size(cfg.actor.world_size) == 4 and cfg.algo.advantage.estimator == "reinforce_baseline"
    assert agent.train.agent_func_path == AGENT_FILE
    ppo = _rest("ppo")
    assert not ppo.kl_penalty().in_loss and ppo.kl_penalty().estimator == "k1"
    assert ppo.kl_controller().value == pytest.approx(0.01)


def test_accepted_switches_are_said_once(caplog):
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        _rest("reinforce_baseline_agent_async")
    said = [r.getMessage() for r in caplog.records]
    for flag in ("ds.enable_sleep", "train.dynamic_batch_enable", "train.micro_batch_size", "rollout.micro_batch_size"):
        assert sum(m.startswith(f"--{flag}: accepted, no switch here") for m in said) == 1, (flag, said)
    assert sum("--train.colocate_all with --train.async_enable" in m for m in said) == 1
    assert sum(m.startswith("--ds.zero_stage without --actor.backend: --actor.backend deepspeed") for m in said) == 1
    assert "--train.colocate_all" in next(m for m in said if m.startswith("--ds.enable_sleep"))


def test_episodes_with_dynamic_filtering_say_what_the_run_takes(caplog):
    """prorlv2_math passes --train.num_episodes 100 with dynamic filtering: the run's length is fixed in steps before
    the filter runs, so it reads more than 100 passes where OpenRLHF stops after them; said once at load, naming both
    flags and --train.num_steps (the step count itself: tests/data/test_prompts.py)."""
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        _rest("prorlv2_math")
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("--train.num_episodes 100 with --algo.dynamic_filtering_enable: the run takes "
                                         "100 x (prompts // --rollout.batch_size) steps")]
    assert len(said) == 1 and "reads about 100 / (the filter's pass rate) passes" in said[0] and "--train.num_steps" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        load_config(None, ["--train.num_episodes", "2"])
        load_config(None, ["--algo.dynamic_filtering_enable"])
    assert not any("with --algo.dynamic_filtering_enable: the run takes" in r.getMessage() for r in caplog.records)


def test_the_ppo_scripts_critic_flags_are_taken_and_gae_runs_them():
    """The ppo script's critic flags translate to ``critic.*`` (its 8 critic ranks, its LR); under our default
    estimator (shape) they do nothing and are refused in one line; under OpenRLHF's (gae) the run is taken (the
    critic's rank group, issue 50)."""
    from openrlhf_shape.config.load import FLAGS, _resolved
    from openrlhf_shape.config.tree import TrainConfig

    argv = without(recipe("ppo"), set(PPO_PARTS))
    cfg = FLAGS.build(TrainConfig(), _resolved(parse_overrides(argv + ["--algo.advantage.estimator", "gae"])))
    assert (cfg.critic.num_nodes, cfg.critic.num_gpus_per_node, cfg.critic.adam.lr) == (1, 8, 9e-6)
    assert cfg.critic.value_clip == 0.5 and cfg.algo.advantage.estimator == "gae"
    with pytest.raises(ValueError, match=r"^--critic\.num_nodes: only --algo.advantage.estimator gae trains a critic"):
        load_config(None, argv)
    assert load_config(None, argv + ["--algo.advantage.estimator", "gae"]).critic.value_clip == 0.5
