"""A short last mini-batch is dropped, as OpenRLHF's actor drops it (its replay-buffer DataLoader in
``PolicyModelActor.ppo_train`` has ``drop_last=True``, read here from the installed source), and the LR schedule's
length (``TrainConfig.total_optimizer_steps``) counts the updates that leaves: a step of 100 samples at
``--train.batch_size 32`` takes 3 updates per pass and drops 4 samples. That the trainer takes exactly these updates
(``actor/updates``, ``actor/dropped_samples``): tests/trainer/test_train_e2e.py's reference run."""

import ast
import os

import pytest
import torch

from openrlhf_shape.config import load_config


def _openrlhf_ppo_train_loader() -> dict:
    """The keywords of the DataLoader call in OpenRLHF 0.11.2's ``ppo_train`` (its module imports CUDA-only
    packages, so its source is read, not imported)."""
    import openrlhf

    path = os.path.join(os.path.dirname(openrlhf.__file__), "trainer", "ray", "ppo_actor.py")
    tree = ast.parse(open(path).read())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "ppo_train")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "DataLoader")
    return {k.arg: k.value for k in call.keywords}


@pytest.mark.parametrize("filtering", [[], ["--algo.dynamic_filtering_enable"]])
def test_the_schedule_counts_the_full_mini_batches_of_each_pass(filtering):
    assert ast.literal_eval(_openrlhf_ppo_train_loader()["drop_last"]) is True
    flags = ["--rollout.batch_size", "25", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "32",
             "--train.num_steps", "5", "--train.max_epochs", "2"] + filtering
    cfg = load_config(None, flags)  # not refused: 32 does not divide 100, the rest is dropped
    per_pass = len(torch.utils.data.DataLoader(range(100), batch_size=32, shuffle=True, drop_last=True))
    assert per_pass == 3 and 100 - per_pass * 32 == 4
    assert cfg.total_optimizer_steps() == 5 * per_pass * 2


def test_a_mini_batch_larger_than_a_step_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--train\.batch_size: 128 is more than the 100 samples of a step"):
        load_config(None, ["--rollout.batch_size", "25", "--rollout.n_samples_per_prompt", "4",
                           "--train.batch_size", "128"])
