"""OpenRLHF 0.11.2's own value-model code (``openrlhf/models/model.py``: ``get_llm_for_sequence_regression`` and
the reward / critic classes it builds), run on CPU.

``openrlhf.models`` does not import here (its ``actor.py`` imports peft, absent; ``ring_attn_utils`` flash_attn), so
the three functions and ``models/utils.py``'s ``set_z3_leaf_modules`` are defined from the installed files' source
with ``ast``, unchanged, and executed with the names they use: torch, nn, transformers' ``AutoConfig`` /
``AutoModel`` / ``HfDeepSpeedConfig``, deepspeed and OpenRLHF's ``init_logger``. The names of the branches a CPU
float run does not take (LoRA, 4-bit, sample packing: peft, bitsandbytes, flash_attn) are left unbound, so taking
one fails loudly instead of running something else. Nothing of OpenRLHF is re-implemented.
"""

from __future__ import annotations

import ast
import os
from typing import Optional

import torch
from torch import nn


def _functions(path: str, names: set[str]) -> ast.Module:
    tree = ast.parse(open(path).read(), filename=path)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in nodes} == names, f"{path} no longer defines {sorted(names)}"
    return ast.Module(body=nodes, type_ignores=[])


def openrlhf_sequence_regression():
    """OpenRLHF's ``get_llm_for_sequence_regression``, defined from its installed source."""
    import deepspeed
    import openrlhf
    from openrlhf.utils.logging_utils import init_logger
    from transformers import AutoConfig, AutoModel
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    base = os.path.dirname(openrlhf.__file__)
    scope: dict = {"torch": torch, "nn": nn, "os": os, "deepspeed": deepspeed, "Optional": Optional,
                   "AutoConfig": AutoConfig, "AutoModel": AutoModel, "HfDeepSpeedConfig": HfDeepSpeedConfig,
                   "logger": init_logger("openrlhf_value_source")}
    for rel, names in ((("models", "utils.py"), {"set_z3_leaf_modules"}),
                       (("models", "model.py"), {"get_llm_for_sequence_regression", "_get_reward_model",
                                                 "_get_critic_model"})):
        path = os.path.join(base, *rel)
        exec(compile(_functions(path, names), path, "exec"), scope)
    return scope["get_llm_for_sequence_regression"]


def openrlhf_save(model: nn.Module, out_dir: str, tokenizer) -> None:
    """What OpenRLHF's ``DeepspeedStrategy.save_model`` writes for an unwrapped model without ZeRO-3 / LoRA: its
    ``save_pretrained`` with the model's state dict, the config as JSON, the tokenizer."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, state_dict={k: v.clone() for k, v in model.state_dict().items()})
    model.config.to_json_file(os.path.join(out_dir, "config.json"))
    tokenizer.save_pretrained(out_dir)
