"""OpenRLHF 0.11.0's rollout-correction flags, accepted and turned into 0.11.2's (issue 46).

0.11.0 (its GitHub tag; the launch scripts there still pass these) had ``--algo.advantage.is_correction_enable`` and
``--algo.advantage.is_correction_type tis|icepop|seq-mask-tis``; 0.11.2 (installed here) has ``_level`` / ``_mode`` /
``_gating``. The mapping (config/compat.py, ``OLD_IS_TYPES``) is read from 0.11.0's ``models/loss.py``: with
``is_correction_enable`` each token's PPO loss is weighted by w = exp(old - rollout log-prob),

* ``tis`` (0.11.0's default type): w clamped into [low, high]           -> level token, mode clip, gating ratio
* ``icepop``: w where low <= w <= high, else 0                           -> level token, mode mask, gating ratio
* ``seq-mask-tis``: w where the response's geometric-mean w is in band   -> level seq, mode mask, gating ratio

and without it nothing is weighted, whatever the type. 0.11.0 is not installed, so its weights are computed here by
hand from those three rules; the translated flags are run through OpenRLHF 0.11.2's own ``PolicyLoss`` (from the
installed source) and through ours, and all three must agree.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from openrlhf_shape.algorithms.rollout_correction import rollout_correction_weights
from openrlhf_shape.config import load_config
from openrlhf_shape.config.compat import FlagError
from test_openrlhf_recipes import AGENT_FILE, HERE, PPO_CRITIC, PPO_PARTS, recipe, without

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "algorithms"))
ENABLE, TYPE = "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type"
CASES = {None: ("token", "clip", "ratio"), "tis": ("token", "clip", "ratio"), "icepop": ("token", "mask", "ratio"),
         "seq-mask-tis": ("seq", "mask", "ratio")}


def _old(kind: str | None) -> list[str]:
    return [ENABLE] + ([TYPE, kind] if kind else [])


def _correction(cfg) -> tuple[str, str, str]:
    a = cfg.algo.advantage
    return a.is_correction_level, a.is_correction_mode, a.is_correction_gating


@pytest.mark.parametrize("kind", list(CASES))
def test_old_names_become_0112s_with_one_note(kind, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        cfg = load_config(None, _old(kind))
    assert _correction(cfg) == CASES[kind] and cfg.algo.advantage.is_correction_threshold == (0.5, 5.0)
    notes = [r.getMessage() for r in caplog.records if "OpenRLHF 0.11.0's names" in r.getMessage()]
    level, mode, _ = CASES[kind]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert (f"is 0.11.2's --algo.advantage.is_correction_level {level} --algo.advantage.is_correction_mode {mode}"
            in notes[0])
    preset = tmp_path / "old.yaml"  # the same names as YAML keys
    preset.write_text("algo:\n  advantage:\n    is_correction_enable: true\n"
                      + (f"    is_correction_type: {kind}\n" if kind else ""))
    assert _correction(load_config(str(preset), [])) == CASES[kind]


def test_type_without_enable_does_nothing_and_mixing_names_is_refused():
    assert load_config(None, [TYPE, "icepop"]).algo.advantage.is_correction_level == "off"
    assert load_config(None, [ENABLE, "false", TYPE, "tis"]).algo.advantage.is_correction_level == "off"
    with pytest.raises(FlagError, match="0.11.0's names for what --algo.advantage.is_correction_level sets"):
        load_config(None, [ENABLE, "--algo.advantage.is_correction_level", "seq"])
    with pytest.raises(FlagError, match="takes tis, icepop, seq-mask-tis"):
        load_config(None, [ENABLE, TYPE, "mis"])


def _openrlhf_0112_policy_loss():
    """OpenRLHF 0.11.2's ``PolicyLoss`` from its installed ``models/loss.py`` (``openrlhf.models`` itself does not import
    on CPU: flash_attn), with ``masked_mean`` from its ``models/utils.py``."""
    from openrlhf_source import _definitions, _exec, _package_dir

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from typing import Optional, Tuple

    base = os.path.join(_package_dir(), "models")
    scope: dict = {"torch": torch, "nn": nn, "dist": dist, "F": F, "Optional": Optional, "Tuple": Tuple}
    _exec(_definitions(os.path.join(base, "utils.py"), {"masked_mean"}), os.path.join(base, "utils.py"), scope)
    _exec(_definitions(os.path.join(base, "loss.py"), {"aggregate_loss", "PolicyLoss"}), os.path.join(base, "loss.py"),
          scope)
    return scope["PolicyLoss"]


def _coefficients_of(policy_loss, old, roll, mask) -> torch.Tensor:
    """The weight OpenRLHF's loss puts on each token: at log_probs = old (ratio 1, no clip) and an advantage of -1 on
    that token alone, the summed loss (``batch_num_tokens`` 1) is that token's weight."""
    out = torch.zeros_like(old)
    for b, t in mask.nonzero().tolist():
        adv = torch.zeros_like(old)
        adv[b, t] = -1.0
        loss = policy_loss(old, old, adv, mask.float(), rollout_log_probs=roll, batch_num_tokens=1.0)[0]
        out[b, t] = loss
    return out


def _by_hand_0110(kind: str | None, old, roll, mask) -> torch.Tensor:
    """0.11.0's weights, by the three rules of the module docstring (band [0.5, 5], its default)."""
    w = (old - roll).exp()
    inside = (w >= 0.5) & (w <= 5.0)
    if kind in (None, "tis"):
        out = w.clamp(0.5, 5.0)
    elif kind == "icepop":
        out = torch.where(inside, w, torch.zeros(()))
    else:
        m = mask.float()
        seq = (((old - roll) * m).sum(-1) / m.sum(-1)).exp()
        out = torch.where(((seq >= 0.5) & (seq <= 5.0))[:, None], w, torch.zeros(()))
    return torch.where(mask, out, torch.zeros(()))


@pytest.mark.parametrize("kind", list(CASES))
def test_old_names_weigh_the_loss_as_openrlhf_0112_does(kind):
    """3 responses of up to 5 tokens, log-ratios in [-1.5, 2] (weights 0.22..7.4: in and out of the band); the last
    response's geometric mean is out of band (seq-mask-tis drops it), the others' in."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    roll = -torch.rand(3, 5, generator=g) * 3 - 0.1
    log_ratio = torch.rand(3, 5, generator=g) * 3.5 - 1.5
    log_ratio[2] = torch.tensor([1.9, 1.8, 2.0, 1.7, 0.0])  # geometric mean e^1.85 > 5
    old = roll + log_ratio
    level, mode, gating = _correction(load_config(None, _old(kind)))
    cfg = load_config(None, _old(kind)).rollout_correction()
    ours, _ = rollout_correction_weights(old, roll, mask, cfg)
    theirs = _coefficients_of(_openrlhf_0112_policy_loss()(is_correction_level=level, is_correction_mode=mode,
                                                           is_correction_gating=gating,
                                                           is_correction_threshold=[0.5, 5.0]), old, roll, mask)
    want = _by_hand_0110(kind, old, roll, mask)
    assert torch.allclose(ours, want, atol=1e-6) and torch.allclose(theirs, want, atol=1e-6), (ours, theirs, want)
    clipped = (want != (old - roll).exp()) & mask  # the band did something: clamped (tis) or dropped tokens
    assert clipped.any() and (mode == "clip" or (want[clipped] == 0).all())


def _old_recipe(name: str) -> list[str]:
    """The script's v0.11.0 command line: its 0.11.2 list with each renamed flag given back its old name (the
    ``# v0.11.0:`` comments above the lines that replaced it)."""
    old = []
    with open(os.path.join(HERE, "openrlhf_recipes", f"{name}.txt")) as f:
        for line in f:
            if line.startswith("# v0.11.0:"):
                old += line.split(":", 1)[1].split("(")[0].split()
    return without(recipe(name), {"algo.advantage.is_correction_level", "algo.advantage.is_correction_mode"}) + old


@pytest.mark.parametrize("name", ["dapo", "prorlv2_math", "reinforce_baseline", "reinforce_baseline_agent_async", "ppo"])
def test_v0110_scripts_load_as_their_0112_rewrite(name):
    def load(argv):
        argv = [AGENT_FILE if a == "examples/python/agent_func.py" else a for a in argv]
        return load_config(None, without(argv, set(PPO_PARTS) | PPO_CRITIC)).to_dict()

    old = _old_recipe(name)
    assert ENABLE in old and "--algo.advantage.is_correction_level" not in old
    assert load(old) == load(recipe(name))


def test_the_mapping_is_the_one_in_compat():
    from openrlhf_shape.config import compat

    assert compat.OLD_IS_TYPES == {k: v for k, v in CASES.items() if k}
