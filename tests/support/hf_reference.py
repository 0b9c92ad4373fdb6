"""What Hugging Face computes on given weights: the reference an engine's log-probs are held to."""

from __future__ import annotations

import os

import torch


# (model directory, its files' modification times) -> (the model as loaded from it, a copy of that state): the
# weight-sync tests ask for a dozen references per engine on one directory, each a load of the model otherwise.
_LOADED: dict[tuple, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}


def _directory_model(model_dir: str | os.PathLike) -> torch.nn.Module:
    """The float32 model of ``model_dir`` holding the directory's own weights: loaded once per directory (and
    again when its files change), then reset to the loaded state before every use, so a call sees exactly
    what a fresh load gives."""
    from transformers import AutoModelForCausalLM

    path = os.path.realpath(model_dir)
    stamp = tuple(sorted((f, os.stat(os.path.join(path, f)).st_mtime_ns) for f in os.listdir(path)
                         if f.endswith((".safetensors", ".json", ".bin"))))
    key = (path, stamp)
    if key not in _LOADED:
        for old in [k for k in _LOADED if k[0] == path]:
            del _LOADED[old]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _LOADED[key] = (model, {k: v.detach().clone() for k, v in model.state_dict().items()})
    model, loaded = _LOADED[key]
    model.load_state_dict(loaded, strict=True)
    model.tie_weights()
    return model


def hf_token_logprobs(model_dir: str | os.PathLike, weights: dict[str, torch.Tensor] | None,
                      sequences: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence of L tokens, the [L - 1] float32 log-probs of tokens[1:] under the model in
    ``model_dir`` with ``weights`` (HF names; None = the directory's own) loaded on top, at
    ``temperature``. A tied model's head follows its embedding, as in the trainer."""
    model = _directory_model(model_dir)
    if weights is not None and not set(weights) <= set(model.state_dict()):
        # Checkpoint names the module does not have: transformers 5 fuses a MoE's per-expert checkpoint
        # tensors (experts.E.gate_proj.weight, ...) into one parameter per layer when it loads, so the
        # weights go through a checkpoint and transformers' own conversion.
        model = _from_checkpoint_weights(model_dir, weights)
    elif weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
            raise ValueError(f"weights do not fit {model_dir}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.long)
            logits = model(ids).logits[0, :-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _from_checkpoint_weights(model_dir: str | os.PathLike, weights: dict[str, torch.Tensor]):
    """The model of ``model_dir`` (its config) with ``weights`` (checkpoint names, e.g. per expert) as its
    checkpoint, loaded by transformers in float32; raises when the names do not cover the model."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf_reference_") as tmp:
        shutil.copy(os.path.join(model_dir, "config.json"), tmp)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()},
                  os.path.join(tmp, "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [m for m in info["missing_keys"] if not (tied and m == "lm_head.weight")]
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise ValueError(f"weights do not fit {model_dir}: missing {missing}, unexpected {info['unexpected_keys']}, "
                         f"mismatched {info.get('mismatched_keys')}")
    return model.eval()


def mean_abs_gap(engine: list[list[float]], reference: list[torch.Tensor]) -> float:
    """Mean |engine - reference| over every token of every sequence (nats)."""
    diffs = [torch.tensor(e, dtype=torch.float32) - r for e, r in zip(engine, reference, strict=True)]
    return float(torch.cat([d.abs() for d in diffs]).mean())
