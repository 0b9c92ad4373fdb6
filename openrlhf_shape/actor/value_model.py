"""OpenRLHF's saved value-model format (reward model and critic) and the Hugging Face value model read from it.

An OpenRLHF reward model or critic (``openrlhf/models/model.py:get_llm_for_sequence_regression``) is the policy's
base model (HF ``AutoModel``: embeddings, layers, final norm) under the causal LM's base-model prefix (``model.``)
and a bias-free linear head ``[1, hidden]`` named by ``value_head_prefix`` (config.json's own, else
``--ds.value_head_prefix``, default ``score``), saved by ``save_pretrained``: weights ``model.*`` and
``score.weight``. Its reward-model training writes the reward ``mean`` and ``std`` into config.json, which
``--reward.normalize_enable`` applies as ``(x - mean) / std`` (to the reward; OpenRLHF's critic applies it to its
values too). The value at position p is the head on the final hidden state at p: a critic's value of the response
token at p is the value at p - 1 (the state it is sampled from), a reward model's reward the value at the
sequence's last token.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

DEFAULT_VALUE_HEAD_PREFIX = "score"  # OpenRLHF's --ds.value_head_prefix default


@dataclasses.dataclass(frozen=True)
class ValueHeadFormat:
    """Where the head's weight lives (``<prefix>.weight``) and the reward statistics of config.json."""

    prefix: str = DEFAULT_VALUE_HEAD_PREFIX
    mean: float = 0.0
    std: float = 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / std`` (``--reward.normalize_enable``), same shape as ``x``."""
        return (x - self.mean) / self.std


def value_head_format(hf_config, default_prefix: str = DEFAULT_VALUE_HEAD_PREFIX) -> ValueHeadFormat:
    """The format of a model directory's config: its ``value_head_prefix`` wins over ``default_prefix``, as in
    OpenRLHF; no ``mean``/``std`` (a critic initialised from a causal LM) means the identity normalisation."""
    prefix = getattr(hf_config, "value_head_prefix", None) or default_prefix
    if getattr(hf_config, "mean", None) is None:
        return ValueHeadFormat(prefix)
    return ValueHeadFormat(prefix, float(hf_config.mean), float(hf_config.std))


def read_checkpoint_tensor(hf_dir: str, name: str) -> torch.Tensor | None:
    """One tensor of an HF directory's safetensors checkpoint (sharded or not), None when it has no ``name``."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            fname = json.load(f)["weight_map"].get(name)
    else:
        fname = "model.safetensors"
    path = os.path.join(hf_dir, fname) if fname else None
    if path is None or not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name) if name in f.keys() else None


def init_value_head(head: nn.Linear, hidden_size: int, seed: int) -> None:
    """A fresh head as OpenRLHF initialises one (``init_value_head``): N(0, 1 / (hidden + 1)), seeded here."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / (hidden_size + 1))


class HFValueModel(nn.Module):
    """The HF base model and the value head, registered under OpenRLHF's names (``model.*``, ``score.weight``),
    so ``state_dict()`` is the saved format."""

    def __init__(self, decoder: nn.Module, base_prefix: str, fmt: ValueHeadFormat):
        super().__init__()
        self.base_prefix, self.fmt = base_prefix, fmt
        hidden = decoder.config.hidden_size
        setattr(self, base_prefix, decoder)
        setattr(self, fmt.prefix, nn.Linear(hidden, 1, bias=False, dtype=next(decoder.parameters()).dtype))

    @property
    def decoder(self) -> nn.Module:
        return getattr(self, self.base_prefix)

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.fmt.prefix)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[rows, seq]`` (packed: ``[1, T]`` with restarting position ids) ->
        raw values float32 (un-normalised): ``[rows, seq]``, one per position, or ``[M]`` at the given
        ``rows``/``pos`` ``[M]`` (:func:`value_positions`)."""
        hidden = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        if rows is not None:
            hidden = hidden[rows, pos]
        return self.head(hidden).squeeze(-1).float()


def load_value_model(hf_dir: str, *, dtype: torch.dtype, attn_implementation: str = "sdpa",
                     default_prefix: str = DEFAULT_VALUE_HEAD_PREFIX, head_seed: int | None = None) -> HFValueModel:
    """The value model of ``hf_dir`` in ``dtype``: an OpenRLHF reward model / critic directory, or a causal LM
    (no head in it) when ``head_seed`` is given, whose head then starts as :func:`init_value_head` draws it.
    Raises naming the flag when the head is missing and no seed is given."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(hf_dir)
    fmt = value_head_format(config, default_prefix)
    decoder = AutoModel.from_pretrained(hf_dir, dtype=dtype, attn_implementation=attn_implementation)
    model = HFValueModel(decoder, _base_prefix(config), fmt)
    weight = read_checkpoint_tensor(hf_dir, f"{fmt.prefix}.weight")
    if weight is not None:
        with torch.no_grad():
            model.head.weight.copy_(weight.reshape(model.head.weight.shape))
    elif head_seed is not None:
        init_value_head(model.head, config.hidden_size, head_seed)
    else:
        raise ValueError(f"{hf_dir} has no value head '{fmt.prefix}.weight': pass an OpenRLHF reward model / "
                         "critic directory, or set --ds.value_head_prefix to the head's name")
    return model


def _base_prefix(config) -> str:
    """The causal LM's base-model attribute (``model`` for Qwen/Llama): the prefix of the saved decoder weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].base_model_prefix


# The class name OpenRLHF's save_pretrained writes as the architecture of each kind (its loader ignores it; a
# causal-LM loader must not take the directory for a policy).
ARCHITECTURES = {"critic": "CriticModel", "reward": "RewardModel"}


def value_config(hf_config, fmt: ValueHeadFormat, *, kind: str, normalize: bool):
    """A copy of the policy's config as OpenRLHF saves a value model's (``kind`` "critic" or "reward"): the
    architecture, the head's name, ``normalize_reward`` and, when the model has them, the reward statistics."""
    import copy

    config = copy.deepcopy(hf_config)
    config.architectures = [ARCHITECTURES[kind]]
    config.value_head_prefix = fmt.prefix
    config.normalize_reward = bool(normalize)
    if fmt != ValueHeadFormat(fmt.prefix):
        config.mean, config.std = fmt.mean, fmt.std
    return config


def export_config(hf_config, fmt: ValueHeadFormat | None):
    """The config a backend's HF export writes: the policy's, or for a value model (``fmt``) OpenRLHF's critic
    config (``--critic.save_value_network``)."""
    return hf_config if fmt is None else value_config(hf_config, fmt, kind="critic", normalize=False)


def save_value_model(model: HFValueModel, out_dir: str, src_dir: str, *, kind: str, normalize: bool) -> None:
    """``model`` as an OpenRLHF value-model directory (``--critic.save_value_network``), in its parameters' dtype,
    with ``src_dir``'s tokenizer files; written atomically by :func:`~openrlhf_shape.actor.hf_dir.write_hf_dir`."""
    from openrlhf_shape.actor.hf_dir import write_hf_dir

    state = [(k, v.detach().to("cpu").contiguous()) for k, v in model.state_dict().items()]
    config = value_config(model.decoder.config, model.fmt, kind=kind, normalize=normalize)
    write_hf_dir([state], out_dir, config, model.head.weight.dtype, src_dir)


def sequence_rewards(values: list[torch.Tensor], fmt: ValueHeadFormat, normalize: bool) -> torch.Tensor:
    """A reward model's score of each sample: its last state's value (``values``: per sample ``[R + 1]`` as
    ``compute_values`` returns them), normalised by ``fmt`` under ``--reward.normalize_enable`` as OpenRLHF's
    reward model does in eval mode -> ``[B]`` float32."""
    last = torch.stack([v[-1].float() for v in values])
    return fmt.normalize(last) if normalize else last


def value_positions(mb) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(rows ``[M]``, positions ``[M]``, per sample its slice) of the states a value model scores in a
    :class:`~openrlhf_shape.actor.batching.MicroBatch`: a sample of prompt P and response R contributes the
    R + 1 positions P - 1 .. P + R - 1 (plus its offset in a packed row). Its values then read: index j < R the
    critic's value of response token j (the state it is sampled from, as ``resp_pos``), index R the value of
    the whole sequence (the reward model's score)."""
    rows: list[int] = []
    pos: list[int] = []
    offsets: list[tuple[int, int]] = []
    for (row, start, length), (a, b) in zip(mb.segments(), mb.resp_offsets):
        end = start + length  # one past the sample's last token
        rows.extend([row] * (b - a + 1))
        pos.extend(range(end - (b - a) - 1, end))
        offsets.append((len(pos) - (b - a + 1), len(pos)))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(pos, dtype=torch.long), offsets
