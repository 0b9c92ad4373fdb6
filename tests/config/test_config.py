"""Training config: YAML + dotted flags, aliases, validation messages that name the flag."""

import os

import pytest
import yaml

from openrlhf_shape.config import load_config
from openrlhf_shape.config.flags import parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_presets_load_and_validate():
    cfg = load_config(os.path.join(ROOT, "configs", "cpu-smoke.yaml"))
    assert cfg.actor.model_name_or_path == "demo" and cfg.shape.num_segments == 4
    for name in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "deepscaler-1.5b", "deepseek-r1-distill-qwen-1.5b"):
        with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as f:
            data = yaml.safe_load(f)
        # cluster paths do not exist here: only check the flags parse and the layout arithmetic holds
        m, a = data["megatron"], data["actor"]
        ranks = a["num_nodes"] * a["num_gpus_per_node"]
        assert ranks % (m["tensor_model_parallel_size"] * m["pipeline_model_parallel_size"]) == 0
        assert data["train"]["batch_size"] == 256 and data["rollout"]["batch_size"] == 128
        assert data["shape"]["num_segments"] == (16 if name.startswith("qwen3") else 8)


@pytest.mark.parametrize("preset", sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")))
def test_presets_use_only_current_flag_names(capsys, preset):
    """A preset a user copies must not teach names that are going away: loading it prints no deprecation."""
    path = os.path.join(ROOT, "configs", preset)
    load_config(path, check_paths=False)
    assert "[deprecated]" not in capsys.readouterr().err


def test_dotted_flags_override_yaml_and_aliases(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n_samples_per_prompt: 4\n  batch_size: 2\ntrain:\n  batch_size: 8\n")
    cfg = load_config(str(p), ["--algo.advantage.estimator", "mrt", "--actor.eps_clip_low_high", "0.1", "0.3",
                               "--rollout.temperature=0.7", "--shape.tcr", "false", "--data.prompt_dataset", "bundled:test"])
    assert cfg.algo.advantage.estimator == "mrt"
    assert (cfg.actor.eps_clip_low_high[0], cfg.actor.eps_clip_low_high[1]) == (0.1, 0.3)
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.n_samples_per_prompt == 4
    assert cfg.shape.tcr is False and cfg.data.prompt_dataset == "bundled:test"
    assert cfg.rollout.batch_size == 2 and cfg.train.batch_size == 8
    # this project's earlier names (never released) are unknown options now, pointing at the current one
    p.write_text("rollout:\n  rollout_batch_size: 2\n")
    with pytest.raises(ValueError, match="did you mean --rollout.batch_size"):
        load_config(str(p), [])


def test_parse_overrides_handles_negatives_and_bare_flags():
    assert parse_overrides(["--rollout.top_k", "-1", "--train.colocate_all", "--a.b=c"]) == [
        ("rollout.top_k", "-1"), ("train.colocate_all", True), ("a.b", "c")]


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--rollout.n_sample_per_prompt", "3"], "did you mean --rollout.n_samples_per_prompt"),
        (["--shape.alpha", "0.6"], r"--shape.alpha.*A\.1"),
        (["--rollout.temperature", "hot"], "--rollout.temperature"),
        (["--train.batch_size", "1000000"], "--train.batch_size: 1000000 is more than the 1024 samples"),
        (["--actor.num_gpus_per_node", "3", "--megatron.tensor_model_parallel_size", "2"], "--actor.num_nodes x"),
        (["--algo.advantage.estimator", "grpo", "--rollout.n_samples_per_prompt", "1",
          "--train.batch_size", "128"], "--rollout.n_samples_per_prompt"),
        (["--ckpt.resume", "/nonexistent/ckpt"], "--ckpt.resume"),
        (["--actor.model_name_or_path", "/nonexistent/model"], "--actor.model_name_or_path"),
        (["--data.prompt_dataset", "/nonexistent/p.jsonl"], "--data.prompt_dataset"),
        (["--actor.eps_clip_low_high", "0.2"], "--actor.eps_clip_low_high"),
        (["--probe.adaptive", "--probe.adaptive_tol", "0.7"], "--probe.adaptive_tol"),
        (["--probe.adaptive", "--probe.max_probes", "16"], r"--shape.gamma_min.*m = 16 probes \(--probe.max_probes\)"),
        (["--probe.max_probes", "-1"], "--probe.max_probes"),
        (["--reward.num_workers", "-2"], "--reward.num_workers"),
    ],
)
def test_bad_flags_name_the_flag(flags, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_config(None, flags)


def test_cli_rejects_unknown_flags_for_commands_without_overrides():
    from openrlhf_shape.cli.main import main

    with pytest.raises(SystemExit):
        main(["analyze", "--nonsense.flag", "1"])
    assert main(["train", "--print_config", "--train.num_steps", "3"]) == 0


def test_adaptive_probe_flags():
    cfg = load_config(None, ["--probe.adaptive", "--probe.adaptive_tol", "0.2", "--probe.max_probes", "8"])
    assert cfg.probe.adaptive and cfg.probe.adaptive_tol == 0.2 and cfg.probe.max_probes == 8
    assert not load_config(None, []).probe.adaptive  # the paper's fixed m is the default
    rule = load_config(None, ["--probe.adaptive"]).probe.rule()  # the documented adaptive default
    assert (rule.first_round, rule.round_size, rule.max_probes, rule.tol) == (4, 5, 9, 0.13)
    assert rule.checkpoints() == [4, 9]  # "4 probes; when they agree stop, else 5 more"
    smoke = load_config(os.path.join(ROOT, "configs", "cpu-smoke.yaml"), []).probe.rule()
    assert (smoke.first_round, smoke.round_size, smoke.max_probes) == (2, 2, 4)
    assert load_config(None, []).reward.num_workers == 0 and load_config(None, []).reward.fast_probe_scoring


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--train.max_staleness", "3"], r"--train\.max_staleness.*3: 1 .* or 2"),
        (["--train.max_staleness", "0", "--train.async_enable", "true"], r"--train\.max_staleness"),
        (["--train.async_queue_size", "2"], r"--train\.async_queue_size.*--train\.max_staleness"),
        (["--train.partial_rollout_enable"], r"--train\.partial_rollout_enable: requires --train\.async_enable"),
        (["--train.async_enable", "true", "--train.partial_rollout_enable", "--rollout.max_new_tokens", "64",
          "--rollout.partial_chunk_tokens", "65"], r"--rollout\.partial_chunk_tokens: 65: must lie in \[1, "),
        (["--rollout.partial_chunk_tokens", "8"], r"--rollout\.partial_chunk_tokens: is read only with --train\.partial"),
        (["--train.async_enable", "true", "--train.partial_rollout_enable", "--rollout.stop", "###"],
         r"--train\.partial_rollout_enable: cannot honour --rollout\.stop"),
    ],
)
def test_async_flags_refused_with_their_reason(flags, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, flags)


def test_partial_rollouts_with_an_agent_run_episodes_whole_and_say_so(caplog, tmp_path):
    """OpenRLHF's agent-async script passes --train.partial_rollout_enable with its agent: accepted, episodes are not
    cut (no round size in effect), said once; without the agent the rounds are cut at the chunk."""
    agent = tmp_path / "a.py"
    agent.write_text("")
    base = ["--train.async_enable", "true", "--train.partial_rollout_enable", "--rollout.max_new_tokens", "64"]
    with caplog.at_level("WARNING", logger="openrlhf_shape.config"):
        cfg = load_config(None, base + ["--train.agent_func_path", str(agent), "--rollout.stop", "###",
                                        "--probe.scorer", "math_verify"], check_paths=False)
    assert cfg.train.partial_rollout_enable and cfg.partial_chunk_in_effect() == 0
    said = [r.getMessage() for r in caplog.records if "agent episodes are not cut" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--train.partial_rollout_enable with --train.agent_func_path")
    assert load_config(None, base).partial_chunk_in_effect() == 16  # a quarter of max_new_tokens
    assert load_config(None, ["--train.async_enable", "true"]).partial_chunk_in_effect() == 0


@pytest.mark.parametrize("estimator", ["shape", "mrt"])
def test_an_agent_with_probes_needs_the_probe_scorer_named(tmp_path, estimator):
    """An agent's rewards come from its environment, which cannot judge a probe: SHAPE/MRT with an agent are refused
    until --probe.scorer names the probes' verifier; the message says what each choice means."""
    agent = tmp_path / "a.py"
    agent.write_text("")
    flags = ["--train.agent_func_path", str(agent), "--algo.advantage.estimator", estimator]
    with pytest.raises(ValueError, match=r"^--probe\.scorer auto .*--probe\.scorer reward \(the reward function.*"
                                         r"--probe\.scorer math_verify \(Math-Verify"):
        load_config(None, flags)
    for scorer in ("reward", "math_verify"):
        assert load_config(None, flags + ["--probe.scorer", scorer]).probe.scorer == scorer
    assert load_config(None, flags[:2] + ["--algo.advantage.estimator", "group_norm"]).probe.scorer == "auto"
    assert load_config(None, ["--algo.advantage.estimator", estimator]).probe.scorer == "auto"  # no agent: auto
    with pytest.raises(ValueError, match=r"--probe\.scorer must be one of auto, reward, math_verify, got 'judge'"):
        load_config(None, ["--probe.scorer", "judge"])


def test_async_with_colocate_all_disaggregates_the_engines_as_openrlhf(caplog):
    """OpenRLHF's --train.colocate_all under --train.async_enable colocates only the training models; one-step-off
    needs the engines on their own devices (colocated, nothing could overlap), which a config built by hand that
    asks for both is still refused for."""
    import dataclasses

    from openrlhf_shape.config.checks import validate

    with caplog.at_level("WARNING", logger="openrlhf_shape.config"):
        cfg = load_config(None, ["--train.async_enable", "true", "--train.colocate_all"])
    assert cfg.train.async_enable is True and cfg.train.colocate_all is False
    assert [r.getMessage() for r in caplog.records if "--train.colocate_all with --train.async_enable" in r.getMessage()]
    both = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, colocate_all=True))
    with pytest.raises(ValueError, match=r"--train\.async_enable.*disaggregated layout"):
        validate(both)


def test_async_flags_accepted_disaggregated():
    cfg = load_config(None, ["--train.async_enable", "true", "--train.max_staleness", "2"])
    assert cfg.train.async_enable is True and cfg.train.max_staleness == 2 and not cfg.train.colocate_all


def test_kl_and_reference_flags():
    """--algo.kl.* and --ref.* land in the tree; KL is off (no reference model) by default; the reference follows the
    actor's rank count unless given; colocated it must match the actor's GPUs (OpenRLHF's rule)."""
    cfg = load_config(None, [])
    assert cfg.algo.kl.init_coef == 0 and not cfg.algo.kl.enabled and cfg.ref.world_size(cfg.actor.world_size) == 1
    cfg = load_config(None, ["--algo.kl.init_coef", "1e-3", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
                             "--algo.kl.target", "0.05", "--algo.kl.horizon", "500", "--actor.num_gpus_per_node", "2",
                             "--train.batch_size", "128"])
    k = cfg.algo.kl
    assert (k.init_coef, k.use_loss, k.estimator, k.target, k.horizon) == (1e-3, True, "k3", 0.05, 500)
    assert cfg.ref.world_size(cfg.actor.world_size) == 2  # both --ref.* unset: the actor's
    pen, ctl = cfg.kl_penalty(), cfg.kl_controller()
    assert ctl.adaptive and (ctl.value, ctl.target, ctl.horizon) == (1e-3, 0.05, 500)
    assert pen.in_loss and pen.estimator == "k3"
    cfg = load_config(None, ["--algo.kl.init_coef", "0.01", "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "4"])
    assert cfg.ref.world_size(cfg.actor.world_size) == 4  # disaggregated: its own GPUs, any multiple of TP x PP


def test_the_rollout_asks_for_the_sampled_tokens_log_probs_where_they_are_the_policys() -> None:
    """Untruncated sampling returns the engines' log-probs of the sampled tokens (every step's rollout/trainer
    mismatch, the correction's weights); under top-p/top-k they are of another distribution: only on request."""
    assert load_config(None, []).rollout.sampling_config().logprobs
    assert not load_config(None, ["--rollout.top_p", "0.9"]).rollout.sampling_config().logprobs
    assert not load_config(None, ["--rollout.top_k", "20"]).rollout.sampling_config().logprobs
    assert load_config(None, ["--rollout.top_k", "20", "--rollout.logprobs"]).rollout.sampling_config().logprobs


def test_the_reward_shaping_flags_reach_the_maker_as_one_value() -> None:
    from openrlhf_shape.algorithms.length_penalty import RewardShaping

    cfg = load_config(None, ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9",
                             "--algo.dynamic_filtering_max_rounds", "5", "--reward.clip_range", "-2", "3",
                             "--reward.stop_properly_penalty_coef", "0.5"])
    assert cfg.reward_shaping() == RewardShaping(True, (0.1, 0.9), 5, (-2.0, 3.0), 0.5)
    assert load_config(None, []).reward_shaping() == RewardShaping()  # the flags' defaults are the value's


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--algo.kl.estimator", "k4"], r"--algo\.kl\.estimator: unknown estimator 'k4'"),
        (["--algo.kl.init_coef", "-0.1"], r"--algo\.kl\.init_coef must be >= 0"),
        (["--algo.kl.target", "0"], r"--algo\.kl\.target must be > 0"),
        (["--algo.kl.unbiased_gradient"], r"--algo\.kl\.unbiased_gradient changes only .*--algo\.kl\.use_loss"),
        (["--algo.kl.init_coef", "0.1", "--train.colocate_all", "--ref.num_gpus_per_node", "2"],
         r"--ref\.num_gpus_per_node: with --train\.colocate_all .* = 2 must equal .* = 1"),
        (["--algo.kl.init_coef", "0.1", "--actor.num_gpus_per_node", "2", "--megatron.tensor_model_parallel_size", "2",
          "--train.batch_size", "128", "--ref.num_gpus_per_node", "3"], r"--ref\.num_gpus_per_node: .* multiple of TP x PP x CP = 2"),
    ],
)
def test_bad_kl_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, flags)


def test_max_engine_restarts_defaults_to_zero_and_refuses_a_negative_budget():
    assert load_config(None, []).rollout.max_engine_restarts == 0  # a dead engine stops the run, as before
    assert load_config(None, ["--rollout.max_engine_restarts", "3"]).rollout.max_engine_restarts == 3
    with pytest.raises(ValueError, match=r"--rollout\.max_engine_restarts: -1: use 0"):
        load_config(None, ["--rollout.max_engine_restarts", "-1"])


def test_engine_stall_timeout_defaults_to_five_minutes_and_refuses_a_negative_bound():
    assert load_config(None, []).rollout.engine_stall_timeout == 300.0
    assert load_config(None, ["--rollout.engine_stall_timeout", "0"]).rollout.engine_stall_timeout == 0.0  # off
    with pytest.raises(ValueError, match=r"--rollout\.engine_stall_timeout: -1(\.0)?: use 0"):
        load_config(None, ["--rollout.engine_stall_timeout", "-1"])


def test_max_restarts_defaults_to_zero_and_refuses_a_negative_budget():
    assert load_config(None, []).train.max_restarts == 0  # a dead rank stops the run, as before
    assert load_config(None, ["--train.max_restarts", "2"]).train.max_restarts == 2
    with pytest.raises(ValueError, match=r"--train\.max_restarts: -1: use 0"):
        load_config(None, ["--train.max_restarts", "-1"])
