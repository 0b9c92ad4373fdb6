"""OpenRLHF 0.11.2's own advantage code, run on CPU (imported by module name: tests/algorithms is on sys.path
under pytest).

``openrlhf.trainer.ppo_utils.experience_maker`` cannot be imported here: it imports ``openrlhf.models`` (peft,
flash_attn: CUDA only) and the Ray launcher. So its class ``RemoteExperienceMaker`` and
``openrlhf.models.utils.compute_reward`` are taken from the installed files' source with ``ast``, unchanged,
and executed with the names they use: torch, itertools, and the real ``apply_length_penalties`` and
``init_logger`` from openrlhf modules that do import; ``models/loss.py``'s ``PolicyLoss``, ``ValueLoss`` and ``aggregate_loss``
the same way (:func:`load_loss_module`). Nothing of OpenRLHF is re-implemented; annotations are
not evaluated (``RayActorGroup`` is only a type annotation). The arguments come from OpenRLHF's own CLI
parser (``cli/train_ppo_ray.py``'s argparse block) and ``openrlhf.utils.config.hierarchize``, so every
setting the method reads has OpenRLHF's default unless the test passes its flag.
"""

from __future__ import annotations

import __future__
import argparse
import ast
import datetime
import itertools
import os
import textwrap
from typing import List, Tuple

import torch


def _package_dir() -> str:
    import openrlhf

    return os.path.dirname(openrlhf.__file__)


def _definitions(path: str, names: set[str]) -> ast.Module:
    tree = ast.parse(open(path).read(), filename=path)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    found = {n.name for n in nodes}
    assert found == names, f"{path} no longer defines {sorted(names - found)}"
    return ast.Module(body=nodes, type_ignores=[])


def _exec(module: ast.Module, path: str, scope: dict) -> None:
    code = compile(module, path, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, scope)


def load_experience_maker():
    """OpenRLHF's ``RemoteExperienceMaker`` class, defined from its installed source."""
    from typing import Union, Optional

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
    from openrlhf.utils.logging_utils import init_logger

    base = _package_dir()
    utils_path = os.path.join(base, "models", "utils.py")
    scope: dict = {"torch": torch, "Union": Union, "Optional": Optional, "Tuple": Tuple, "List": List}
    _exec(_definitions(utils_path, {"compute_reward"}), utils_path, scope)
    maker_path = os.path.join(base, "trainer", "ppo_utils", "experience_maker.py")
    scope.update(itertools=itertools, Experience=Experience, apply_length_penalties=apply_length_penalties,
                 logger=init_logger("openrlhf_source"))
    _exec(_definitions(maker_path, {"RemoteExperienceMaker"}), maker_path, scope)
    return scope["RemoteExperienceMaker"]


def load_loss_module() -> dict:
    """OpenRLHF's ``PolicyLoss``, ``ValueLoss``, ``aggregate_loss`` (``models/loss.py``), ``compute_approx_kl``, ``compute_reward``
    and ``masked_mean`` (``models/utils.py``), defined from the installed source: a name -> object dict."""
    from typing import Optional, Union

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    base = _package_dir()
    scope: dict = {"torch": torch, "nn": nn, "F": F, "dist": dist, "Optional": Optional, "Tuple": Tuple,
                   "Union": Union, "List": List}
    utils_path = os.path.join(base, "models", "utils.py")
    utils = _definitions(utils_path, {"compute_approx_kl", "compute_reward", "masked_mean"})
    tree = ast.parse(open(utils_path).read(), filename=utils_path)  # the constant compute_approx_kl reads
    consts = [n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "KL_IS_WEIGHT_CLIP"
                                                                          for t in n.targets)]
    assert consts, f"{utils_path} no longer defines KL_IS_WEIGHT_CLIP"
    _exec(ast.Module(body=consts + utils.body, type_ignores=[]), utils_path, scope)
    loss_path = os.path.join(base, "models", "loss.py")
    _exec(_definitions(loss_path, {"PolicyLoss", "ValueLoss", "aggregate_loss"}), loss_path, scope)
    return scope


def _method_block(relpath: str, cls: str, method: str, test_src: str) -> ast.Module:
    """The ``if <test_src>:`` statement (first match, at any depth) of ``cls.method`` in an installed OpenRLHF file:
    a block of a method that cannot run here as a whole (Ray, CUDA), executed on its own with the names it reads."""
    path = os.path.join(_package_dir(), relpath)
    klass = next(n for n in _definitions(path, {cls}).body)
    fn = next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    assert fn is not None, f"{path}: {cls}.{method} is gone"
    found = [n for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test).startswith(test_src)]
    assert found, f"{path}: {cls}.{method} no longer has `if {test_src}...`"
    return ast.Module(body=[found[0]], type_ignores=[])


def openrlhf_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: dict):
    """The LR scheduler OpenRLHF's ``DeepspeedStrategy._ds_init_train_model`` builds for ``optimizer`` from the model's
    ``cfg`` (``scheduler_steps``, ``lr_scheduler``, ``lr_warmup_ratio``, ``min_lr_ratio``: what ``ppo_actor.py`` passes):
    its statements from ``scheduler_steps = ...`` to ``sched_factory = ...``, run with transformers' ``get_scheduler``
    as the file imports it, the factory then called on ``optimizer`` (DeepSpeed's ``initialize`` does that)."""
    import math
    from functools import partial

    from transformers.trainer import get_scheduler

    path = os.path.join(_package_dir(), "utils", "deepspeed", "deepspeed.py")
    klass = next(n for n in _definitions(path, {"DeepspeedStrategy"}).body)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "_ds_init_train_model")
    names = [next((t.id for t in getattr(n, "targets", []) if isinstance(t, ast.Name)), None) for n in fn.body]
    assert "scheduler_steps" in names and "sched_factory" in names, f"{path}: the scheduler block moved"
    block = fn.body[names.index("scheduler_steps"): names.index("sched_factory") + 1]
    scope = {"cfg": dict(cfg), "math": math, "partial": partial, "get_scheduler": get_scheduler}
    _exec(ast.Module(body=block, type_ignores=[]), path, scope)
    return scope["sched_factory"](optimizer)


def openrlhf_status_mean(status_list: list[dict]) -> dict:
    """``ActorPPOTrainer.ppo_train``'s step aggregation of its per-update statuses (``status_mean``: "token"-weighted
    keys by ``_num_action_tokens``, the others by ``_num_samples``, grad norm and LR the last), run from its source."""
    scope = {"status_list": status_list}
    _exec(_method_block("trainer/ray/ppo_actor.py", "ActorPPOTrainer", "ppo_train", "status_list"),
          "ppo_actor.py", scope)
    return scope["status_mean"]


def openrlhf_dynamic_filter_keeps(scores: list[float], lo: float, hi: float) -> bool:
    """Whether OpenRLHF's dynamic filter (``SamplesGenerator._generate_vllm``) keeps one prompt's group of samples
    with these ``scores`` under ``--algo.dynamic_filtering_range lo hi``, run from its source."""
    from types import SimpleNamespace

    from openrlhf.utils.logging_utils import init_logger

    exps = [SimpleNamespace(scores=torch.tensor([s])) for s in scores]
    args = SimpleNamespace(algo=SimpleNamespace(dynamic_filtering_range=(lo, hi)))
    scope = {"dynamic_filtering": True, "experiences": exps, "self": SimpleNamespace(args=args),
             "logger": init_logger("openrlhf_source")}
    _exec(_method_block("trainer/ppo_utils/samples_generator.py", "SamplesGenerator", "_generate_vllm",
                        "dynamic_filtering and all("), "samples_generator.py", scope)
    return bool(scope["experiences"])


def openrlhf_parser() -> argparse.ArgumentParser:
    """OpenRLHF's PPO argument parser (``cli/train_ppo_ray.py``'s argparse block, nothing else of the file)."""
    path = os.path.join(_package_dir(), "cli", "train_ppo_ray.py")
    src = open(path).read()
    block = src.split('if __name__ == "__main__":', 1)[1].split("args = parser.parse_args()", 1)[0]
    scope = {"argparse": argparse, "datetime": datetime.datetime}
    exec(textwrap.dedent(block), scope)  # only parser.add_argument(...) calls
    return scope["parser"]


def openrlhf_args(argv: list[str]):
    """OpenRLHF's hierarchical args for a PPO command line (its own parser and defaults)."""
    from openrlhf.utils.config import hierarchize

    return hierarchize(openrlhf_parser().parse_args(argv))


def openrlhf_defaults() -> dict:
    """Every PPO flag of OpenRLHF's parser (name without ``--``) -> its default, as the parser sets it."""
    return {a.option_strings[0][2:]: a.default for a in openrlhf_parser()._actions
            if a.option_strings and a.option_strings[0] != "-h"}


def openrlhf_advantages(argv: list[str], rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None,
                        kl_coef: float, splits: int = 2) -> torch.Tensor:
    """Advantages ``[B, T]`` from OpenRLHF's ``compute_advantages_and_returns`` for outcomes ``rewards`` ``[B]``
    (prompt-major, n contiguous), ``mask`` ``[B, T]``, KL ``[B, T]`` (None: 0) at coefficient ``kl_coef``, the
    batch split into ``splits`` experiences (its whitening is global over them)."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args = openrlhf_args(argv)
    maker = load_experience_maker()(None, None, None, None, FixedKLController(kl_coef),
                                    SimpleNamespace(args=args), None)
    kl = torch.zeros(mask.shape) if kl is None else kl
    parts = torch.arange(rewards.numel()).tensor_split(splits)
    exps = [Experience(action_mask=mask[idx].clone(), rewards=rewards[idx].clone(), kl=kl[idx].clone(),
                       response_length=mask[idx].sum(-1), index=idx.tolist(), info={}) for idx in parts]
    exps = maker.compute_advantages_and_returns(exps)
    return torch.cat([e.advantages for e in exps], dim=0)


def openrlhf_gae(argv: list[str], rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 kl: torch.Tensor | None, kl_coef: float, splits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each ``[B, T]``, from OpenRLHF's ``compute_advantages_and_returns`` with
    ``--algo.advantage.estimator gae`` (added to ``argv``) for outcomes ``rewards`` ``[B]``, the critic's ``values``
    ``[B, T]``, ``mask`` ``[B, T]``, KL ``[B, T]`` (None: 0) at coefficient ``kl_coef``, the batch split into
    ``splits`` experiences (its whitening is global over them)."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args = openrlhf_args(["--algo.advantage.estimator", "gae", *argv])
    maker = load_experience_maker()(None, None, None, None, FixedKLController(kl_coef),
                                    SimpleNamespace(args=args), None)
    kl = torch.zeros(mask.shape) if kl is None else kl
    parts = torch.arange(rewards.numel()).tensor_split(splits)
    exps = [Experience(action_mask=mask[idx].clone(), rewards=rewards[idx].clone(), kl=kl[idx].clone(),
                       values=values[idx].clone(), response_length=mask[idx].sum(-1), index=idx.tolist(), info={})
            for idx in parts]
    exps = maker.compute_advantages_and_returns(exps)
    return torch.cat([e.advantages for e in exps], dim=0), torch.cat([e.returns for e in exps], dim=0)
