"""One rule for defaults (issue 46): a flag OpenRLHF has takes OpenRLHF's default here, unless its row in
``config/openrlhf.py`` is ``own`` and says why. Checked by a machine against OpenRLHF 0.11.2's own parser (built
from the installed package's source: tests/algorithms/openrlhf_source.py): OpenRLHF's default of every ``same``
row, given as the flag, leaves our config as it is; an ``own`` row's does not. A run that leaves an ``own`` flag
unset is told so in one line at start-up, with OpenRLHF's value to pass."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys

import pytest

from openrlhf_shape.actor.optim import AdamConfig
from openrlhf_shape.config import TrainConfig, load_config
from openrlhf_shape.config.load import default_mismatches
from openrlhf_shape.config.openrlhf import BY_NAME, OPENRLHF_PPO_FLAGS, OWN, SAME, markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "algorithms"))


@pytest.fixture(scope="module")
def theirs() -> dict:
    from openrlhf_source import openrlhf_defaults

    return openrlhf_defaults()


def test_every_row_follows_the_rule_against_openrlhfs_parser(theirs):
    assert len(theirs) == len(OPENRLHF_PPO_FLAGS) == 167
    assert default_mismatches(theirs) == []
    kinds = {f.kind for f in OPENRLHF_PPO_FLAGS}
    assert {SAME, OWN} <= kinds and sum(f.kind == SAME for f in OPENRLHF_PPO_FLAGS) > 50


@pytest.mark.parametrize("flag, wrong", [("actor.adam.eps", 1e-6), ("actor.lr_warmup_ratio", 0.0)])
def test_a_planted_wrong_recorded_default_is_reported(theirs, flag, wrong):
    rows = [dataclasses.replace(f, default=wrong) if f.name == flag else f for f in OPENRLHF_PPO_FLAGS]
    found = default_mismatches(theirs, rows)
    assert len(found) == 1 and found[0].startswith(f"--{flag}: the table records the default {wrong!r}"), found


def test_a_planted_wrong_default_of_ours_is_reported(theirs):
    """Our old Adam betas, warm-up and clip-higher, as the table said SAME before issue 46."""
    base = TrainConfig()
    ours = dataclasses.replace(base, actor=dataclasses.replace(
        base.actor, adam=AdamConfig(betas=(0.9, 0.999)), lr_warmup_ratio=0.0, eps_clip_low_high=(0.2, 0.28)))
    found = default_mismatches(theirs, ours=ours)
    named = sorted(line.split(":")[0] for line in found)
    assert named == ["--actor.adam.betas", "--actor.eps_clip_low_high", "--actor.lr_warmup_ratio"], found
    assert "--actor.adam.betas 0.9 0.999" in next(ln for ln in found if ln.startswith("--actor.adam.betas"))


def test_a_planted_wrong_kind_is_reported(theirs, monkeypatch):
    """An own default marked same (KL 0 vs OpenRLHF's 0.01) and a same default marked own are both wrong; so is a
    values row whose accepted OpenRLHF default is not ours (a cosine schedule here vs a constant one)."""
    rows = [dataclasses.replace(f, kind={"algo.kl.init_coef": SAME, "train.seed": OWN}.get(f.name, f.kind))
            for f in OPENRLHF_PPO_FLAGS]
    found = sorted(default_mismatches(theirs, rows))
    assert len(found) == 2, found
    assert found[0].startswith("--algo.kl.init_coef: same row, but OpenRLHF's default 0.01 is not ours")
    assert found[1].startswith("--train.seed: own row, but our default is OpenRLHF's 42")
    base = TrainConfig()
    constant = dataclasses.replace(base, actor=dataclasses.replace(base.actor, lr_scheduler="constant"))
    assert [ln.split(":")[0] for ln in default_mismatches(theirs, ours=constant)] == ["--actor.lr_scheduler"]


def test_openrlhf_clip_rule_eps_clip_both_sides_unless_low_high(tmp_path):
    """OpenRLHF: eps_clip_low_high unset -> (eps_clip, eps_clip); given (on the command line or in the file), it wins."""
    assert load_config(None, []).actor.clip_bounds == (0.2, 0.2)
    assert load_config(None, ["--actor.eps_clip", "0.3"]).actor.clip_bounds == (0.3, 0.3)
    both = ["--actor.eps_clip", "0.3", "--actor.eps_clip_low_high", "0.2", "0.28"]
    assert load_config(None, both).actor.clip_bounds == (0.2, 0.28)
    preset = tmp_path / "p.yaml"
    preset.write_text("actor:\n  eps_clip_low_high: [0.2, 0.28]\n")
    assert load_config(str(preset), ["--actor.eps_clip", "0.1"]).actor.clip_bounds == (0.2, 0.28)
    assert load_config(None, both).megatron_config().optim.eps_clip_low_high == (0.2, 0.28)  # what a rank reads
    assert load_config(None, ["--actor.eps_clip", "0.1"]).zero_config().optim.eps_clip_low_high == (0.1, 0.1)


def test_load_enable_false_starts_over():
    assert load_config(None, ["--ckpt.load_enable"]).ckpt.resume == "auto"
    assert load_config(None, ["--ckpt.load_enable", "false"]).ckpt.resume == "none"


def _note(caplog, yaml_path=None, flags=()) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        load_config(yaml_path, list(flags))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OpenRLHF defaults this run")]
    assert len(said) == 1, said  # once, one line
    return said[0]


def test_the_unset_own_defaults_are_said_once_with_openrlhfs_value(caplog, tmp_path):
    bare = _note(caplog)
    own = [f for f in OPENRLHF_PPO_FLAGS if f.kind == OWN]
    for f in own:
        assert f"--{f.name} " in bare, f.name
    assert "--algo.kl.init_coef 0.0 [0.01]" in bare and "--rollout.batch_size 128 [1024]" in bare
    assert "--ckpt.load_enable auto [false]" in bare and "--data.max_len 9216 [2048]" in bare
    assert "--algo.advantage.estimator shape [gae]" in bare
    assert "--actor.adam.betas" not in bare and "--train.seed" not in bare  # OpenRLHF's defaults: nothing to say
    # set on the command line, in the file, or through what stands for it: not said
    preset = tmp_path / "p.yaml"
    preset.write_text("algo:\n  kl:\n    init_coef: 0.0\nckpt:\n  resume: none\n")
    given = _note(caplog, str(preset), ["--rollout.batch_size", "1024", "--data.max_len", "4096",
                                        "--algo.advantage.estimator", "grpo"])
    for gone in ("algo.kl.init_coef", "rollout.batch_size", "ckpt.load_enable", "data.max_len",
                 "rollout.max_new_tokens", "algo.advantage.estimator"):
        assert f"--{gone} " not in given, gone
    assert "--train.batch_size 256 [128]" in given


def test_the_doc_marks_the_machine_checked_rows():
    table = markdown_table()
    checked = [f for f in OPENRLHF_PPO_FLAGS if f.checked_by]
    assert len(checked) >= 10
    for f in checked:
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| `--{f.name}` |"))
        assert "Machine-checked against OpenRLHF's own code" in row and f.checked_by[0] in row


@pytest.mark.parametrize("test", sorted({t for f in OPENRLHF_PPO_FLAGS for t in f.checked_by}))
def test_each_machine_check_names_a_test_that_runs_openrlhfs_code(test):
    path, name = test.split("::")
    src = open(os.path.join(ROOT, path)).read()
    assert re.search(rf"^def {name}\(", src, re.M), f"{path} has no test {name}"
    assert re.search(r"from openrlhf[._]|_load_openrlhf|openrlhf_source", src), f"{path} runs no OpenRLHF code"


def test_own_rows_render_both_defaults():
    table = markdown_table()
    row = next(ln for ln in table.splitlines() if ln.startswith("| `--vllm.enable_prefix_caching` |"))
    assert "our own default `true` (OpenRLHF's `false`)" in row and BY_NAME["vllm.enable_prefix_caching"].why in row
