"""The OpenRLHF flag table covers exactly the PPO flags of the installed OpenRLHF 0.11.2, with its
defaults. The flags are read from the real package's ``cli/train_ppo_ray.py``: its argparse block
is built with plain argparse (the module itself cannot be imported on CPU: its trainer imports
flash_attn)."""

import argparse
import datetime
import importlib.util
import os
import textwrap

import pytest

from openrlhf_shape.config.openrlhf import ALWAYS, BY_NAME, OPENRLHF_PPO_FLAGS, OWN, REFUSED, SAME, VALUES, refusal


def _openrlhf_parser() -> argparse.ArgumentParser:
    spec = importlib.util.find_spec("openrlhf")
    assert spec is not None and spec.origin, "openrlhf is not installed (see requirements/cpu.txt)"
    src_path = os.path.join(os.path.dirname(spec.origin), "cli", "train_ppo_ray.py")
    src = open(src_path).read()
    block = src.split('if __name__ == "__main__":', 1)[1].split("args = parser.parse_args()", 1)[0]
    scope = {"argparse": argparse, "datetime": datetime.datetime}
    exec(textwrap.dedent(block), scope)  # only parser.add_argument(...) calls
    return scope["parser"]


def test_table_covers_every_openrlhf_ppo_flag_with_its_default():
    import openrlhf

    assert openrlhf.__version__ == "0.11.2" if hasattr(openrlhf, "__version__") else True
    parser = _openrlhf_parser()
    theirs = {a.option_strings[0][2:]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert set(theirs) == set(BY_NAME), (sorted(set(theirs) - set(BY_NAME)), sorted(set(BY_NAME) - set(theirs)))
    assert len(theirs) == 167
    for name, action in theirs.items():
        ours = BY_NAME[name].default
        if name == "logger.wandb.run_name":
            continue  # a timestamp
        want = list(action.default) if isinstance(action.default, (list, tuple)) else action.default
        got = list(ours) if isinstance(ours, (list, tuple)) else ours
        assert got == want, f"--{name}: table default {ours!r}, OpenRLHF {action.default!r}"


def test_every_refusal_is_one_line_that_says_why():
    kinds = {k: [f for f in OPENRLHF_PPO_FLAGS if f.kind == k] for k in (SAME, OWN, ALWAYS, VALUES, REFUSED)}
    assert sum(map(len, kinds.values())) == 167
    for f in kinds[REFUSED]:
        msg = refusal(f.name, "x")
        assert msg and msg.startswith(f"--{f.name}: ") and "\n" not in msg and len(f.why) > 15
    for f in kinds[SAME] + kinds[OWN] + kinds[ALWAYS]:
        assert refusal(f.name, "anything") is None
    for f in kinds[OWN]:  # an own default says why
        assert len(f.why) > 15, f.name
    assert refusal("algo.kl.init_coef", "0") is None and refusal("algo.kl.init_coef", "1e-3") is None
    assert "--train.colocate_all" in refusal("train.colocate_actor_ref", True)
    assert refusal("algo.advantage.estimator", "group_norm") is None
    assert refusal("algo.advantage.estimator", "gae") is None  # accepted; the run is refused by load_config
    assert refusal("logger.logging_steps", 1) is None and refusal("logger.logging_steps", "5")


@pytest.mark.parametrize("name", ["ds.zpg", "ds.deepcompile", "train.colocate_actor_ref"])
def test_parts_we_do_not_have_are_named(name):
    assert refusal(name, True).startswith(f"--{name}: ")


def test_packing_samples_is_accepted_as_always_on():
    # samples are packed into one row on both backends (actor/batching.py); OpenRLHF's switch has no effect
    assert refusal("ds.packing_samples", True) is None and refusal("ds.packing_samples", False) is None


def test_compat_doc_table_is_the_table():
    from openrlhf_shape.config.openrlhf import markdown_table, render_doc, summary

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "docs", "openrlhf_compat.md")).read()
    stale = "docs/openrlhf_compat.md is stale: python scripts/render_openrlhf_compat.py"
    assert markdown_table() in readme and summary() in readme, stale
    assert render_doc(readme) == readme, stale
    assert readme.count("\n| `--") == len(OPENRLHF_PPO_FLAGS)  # one row per flag, nothing else
