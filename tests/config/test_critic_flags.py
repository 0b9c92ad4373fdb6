"""``--critic.*``, ``--train.colocate_critic_reward`` and ``--algo.advantage.lambd`` (issue 50): parsed into our fields
with OpenRLHF 0.11.2's defaults (its own parser's, read by tests/config/test_openrlhf_defaults.py for every same row),
validated at the edge naming the flag, bound to what uses them (the critic's optimiser config, GAE's lambda), refused
where nothing reads them, and a run with gae refused in one line until the critic's rank group exists."""

from __future__ import annotations

import pytest

from openrlhf_shape.config import FLAGS, load_config
from openrlhf_shape.config.load import _resolved
from openrlhf_shape.config.flags import parse_overrides
from openrlhf_shape.config.tree import TrainConfig


def _built(argv: list[str]) -> TrainConfig:
    """The config the flags build, before the cross-section checks (which refuse gae for now)."""
    return FLAGS.build(TrainConfig(), _resolved(parse_overrides(argv)))


def test_defaults_are_openrlhfs():
    from openrlhf.utils.config import hierarchize
    from test_openrlhf_flag_table import _openrlhf_parser

    theirs, ours = hierarchize(_openrlhf_parser().parse_args([])), TrainConfig()
    for name in ("value_clip", "freezing_steps", "save_value_network", "lr_scheduler", "lr_warmup_ratio",
                 "min_lr_ratio", "max_norm", "model_name_or_path"):
        assert getattr(ours.critic, name) == getattr(theirs.critic, name), name
    assert ours.critic.adam.lr == theirs.critic.adam.lr == 9e-6
    assert tuple(ours.critic.adam.betas) == tuple(theirs.critic.adam.betas)
    assert ours.train.colocate_critic_reward is theirs.train.colocate_critic_reward is False
    assert ours.algo.advantage.lambd == theirs.algo.advantage.lambd == 1


def test_flags_reach_the_critics_optimiser_and_gae():
    cfg = _built(["--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "0.99", "--algo.advantage.lambd",
                  "0.95", "--critic.adam.lr", "5e-6", "--critic.lr_scheduler", "constant_with_warmup",
                  "--critic.lr_warmup_ratio", "0.1", "--critic.max_norm", "0.5", "--critic.value_clip", "0.2",
                  "--critic.num_gpus_per_node", "2", "--actor.adam.lr", "1e-6"])
    est = cfg.advantage_estimator()
    assert est.name == "gae" and est.returns.lambd == 0.95 and est.returns.gamma == 0.99
    opt = cfg.critic_optim_config()
    assert (opt.adam.lr, opt.lr_scheduler, opt.max_norm) == (5e-6, "constant_with_warmup", 0.5)
    assert opt.total_steps == cfg.optim_config().total_steps and cfg.optim_config().adam.lr == 1e-6
    assert opt.warmup_steps == -(-opt.total_steps // 10)  # ceil(0.1 x steps), the critic's own ratio
    assert cfg.critic.world_size(cfg.actor.world_size) == 2  # nodes unset: OpenRLHF's 1 node x 2 GPUs
    assert _built([]).critic.world_size(4) == 4  # both unset: as many as the actor's
    assert cfg.critic_model_path() == cfg.actor.model_name_or_path
    assert _built(["--critic.model_name_or_path", "/m"]).critic_model_path() == "/m"
    # OpenRLHF's rule (train_ppo_ray): unset, the critic starts from the reward model when one is given
    assert _built(["--reward.model_name_or_path", "/rm"]).critic_model_path() == "/rm"
    assert _built(["--reward.model_name_or_path", "/rm", "--critic.model_name_or_path", "/m"]).critic_model_path() == "/m"


@pytest.mark.parametrize("flags, match", [
    (["--critic.value_clip", "-0.1"], r"^--critic\.value_clip must be >= 0"),
    (["--critic.freezing_steps", "-2"], r"^--critic\.freezing_steps must be >= -1"),
    (["--critic.adam.lr", "0"], r"^--critic\.adam\.lr must be > 0"),
    (["--critic.min_lr", "1"], r"^--critic\.min_lr must be in \[0, adam\.lr"),
    (["--critic.lr_scheduler", "polynomial"], r"--critic\.lr_scheduler polynomial: .*accepted here: cosine_with_min_lr"),
    (["--algo.advantage.lambd", "1.5", "--algo.advantage.estimator", "gae"], r"--algo\.advantage\.lambd.*\[0, 1\]"),
    (["--algo.advantage.lambd", "0.9", "--algo.advantage.estimator", "reinforce"],
     r"^--algo\.advantage\.lambd 0\.9: only --algo\.advantage\.estimator gae"),
    (["--critic.value_clip", "0.2", "--train.colocate_critic_reward"],
     r"^--critic\.value_clip: only --algo\.advantage\.estimator gae trains a critic.*shape.*drop --critic\.value_clip, "
     r"--train\.colocate_critic_reward$"),
    (["--algo.advantage.estimator", "gae", "--train.colocate_all", "--critic.num_gpus_per_node", "2"],
     r"^--critic\.num_gpus_per_node: with --train\.colocate_all the critic shares the actor's GPUs one for one"),
    (["--algo.advantage.estimator", "gae", "--train.colocate_critic_reward", "--reward.model_name_or_path", "demo",
      "--critic.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "4", "--actor.num_gpus_per_node", "2",
      "--train.batch_size", "128"],
     r"^--train\.colocate_critic_reward: critic rank r shares reward rank r's GPU .* = 2 must equal "
     r"--reward\.num_nodes x --reward\.num_gpus_per_node = 4"),
])
def test_bad_or_unread_settings_are_refused_naming_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, flags)
