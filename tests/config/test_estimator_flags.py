"""``--algo.advantage.estimator`` takes OpenRLHF's critic-free estimators, with ``--algo.advantage.gamma`` and
``--algo.advantage.no_std_norm`` bound to the estimator the run builds; settings it cannot honour are refused by
flag; ``--shape.tcr`` unset means the estimator's own default (SHAPE on, MRT off)."""

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.config.openrlhf import refusal


@pytest.mark.parametrize("given, ours", [("reinforce", "reinforce"), ("reinforce_baseline", "reinforce_baseline"),
                                         ("rloo", "rloo"), ("dr_grpo", "dr_grpo"), ("flash_reinforce", "flash_reinforce"),
                                         ("group_norm", "grpo")])
def test_openrlhf_estimators_are_accepted_and_bound(given, ours):
    assert refusal("algo.advantage.estimator", given) is None
    cfg = load_config(None, ["--algo.advantage.estimator", given, "--algo.advantage.gamma", "1.0"])
    assert cfg.algo.advantage.estimator == ours
    est = cfg.advantage_estimator()
    assert est.name == ours and not est.needs_segments


def test_reinforce_takes_gamma_and_no_std_norm():
    cfg = load_config(None, ["--algo.advantage.estimator", "reinforce", "--algo.advantage.gamma", "0.99",
                             "--algo.advantage.no_std_norm"])
    est = cfg.advantage_estimator()
    assert est.returns.gamma == pytest.approx(0.99) and est.returns.no_std_norm is True


@pytest.mark.parametrize("flags, match", [
    (["--algo.advantage.estimator", "reinforce_baseline", "--algo.advantage.gamma", "0.9"],
     r"--algo.advantage.gamma 0.9: only --algo.advantage.estimator reinforce or gae discounts"),
    (["--algo.advantage.gamma", "0.9"], r"--algo.advantage.gamma 0.9: .*--shape.gamma_min"),  # shape, the default
    (["--algo.advantage.estimator", "group_norm", "--algo.advantage.no_std_norm"],
     r"--algo.advantage.no_std_norm: grpo does not whiten"),
    (["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "1", "--train.batch_size", "128"],
     r"--rollout.n_samples_per_prompt: .*rloo.* >= 2 samples per prompt"),
    (["--algo.advantage.estimator", "reinforce", "--algo.advantage.gamma", "1.5"], r"--algo.advantage.gamma.*\[0, 1\]"),
])
def test_settings_an_estimator_cannot_honour_are_refused_by_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, flags)


def test_one_sample_per_prompt_is_fine_for_reinforce_and_flash_reinforce():
    for name in ("reinforce", "flash_reinforce"):
        cfg = load_config(None, ["--algo.advantage.estimator", name, "--rollout.n_samples_per_prompt", "1",
                                 "--train.batch_size", "128"])
        assert cfg.rollout.n_samples_per_prompt == 1


def test_gae_is_taken_with_its_critic():
    """The parser takes gae (a registered estimator) and the run with it (issue 50: the critic's rank group), its
    critic placed with the actor's world."""
    from openrlhf_shape.cluster.placement import plan_for

    assert refusal("algo.advantage.estimator", "gae") is None
    cfg = load_config(None, ["--algo.advantage.estimator", "gae"])
    assert cfg.advantage_estimator().needs_critic and len(plan_for(cfg, on_gpu=False).critics) == 1
    assert plan_for(load_config(None, []), on_gpu=False).critics == ()


def test_tcr_default_follows_the_estimator():
    assert load_config(None, []).shape.tcr is None
    assert load_config(None, []).advantage_estimator().uses_tcr is True  # shape
    assert load_config(None, ["--algo.advantage.estimator", "mrt"]).advantage_estimator().uses_tcr is False
    assert load_config(None, ["--algo.advantage.estimator", "mrt", "--shape.tcr"]).advantage_estimator().uses_tcr
    assert not load_config(None, ["--shape.tcr", "off"]).advantage_estimator().uses_tcr
