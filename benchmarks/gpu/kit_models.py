"""Models and FLOP accounting of the GPU verification kit (see scripts/gpu_check.sh).

Random-weight stand-ins are built from ``configs/models/<name>.json`` (architecture only); the
tiny smoke model comes from :mod:`openrlhf_shape.testing.tiny_models`.

FLOP formula (dense decoder, GQA, gated MLP; multiply-add = 2 FLOPs), per optimizer step or pass:

    N_layer   = L * (h * d * (2 * n_q + 2 * n_kv) + 3 * h * f)     matmul parameters of the blocks
    F_dense   = 2 * N_layer * T                                    T = tokens (prompt + response)
    F_attn    = sum over sequences of 2 * L * n_q * d * s^2        QK^T and AV, causal (half of s^2)
    F_head    = 2 * h * V * R                                      R = response positions (logits
                                                                   are only computed there)
    forward   = F_dense + F_attn + F_head
    model FLOPs   (MFU):  update = 3 * forward (forward + backward),  log-prob pass = 1 * forward
    hardware FLOPs (HFU): update with full activation recompute = 4 * forward (each block and
                          each log-prob chunk runs its forward again in backward)

Mixture of experts (``qwen3_moe``): a sparse layer's MLP term is what one token runs through, the router
and ``k`` experts, ``h * E + 3 * h * f_e * k`` (f_e = moe_intermediate_size, E experts, top-k ``k``), so
MFU counts the active parameters (layers listed in ``mlp_only_layers`` keep the dense MLP).

Embedding look-ups and norms are not counted. For models with untied embeddings the input
embedding is a look-up, not a matmul, so it never counts; the output layer counts through
F_head only. MFU = model FLOPs / seconds / peak, peak = 989e12 (H100 SXM dense bf16).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

H100_BF16_DENSE_PEAK = 989e12
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_CONFIG_DIR = os.path.join(REPO_ROOT, "configs", "models")


def model_config_path(name: str) -> str:
    """``configs/models/<name>.json``; raises with the available names if it does not exist."""
    path = os.path.join(MODEL_CONFIG_DIR, f"{name}.json")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(MODEL_CONFIG_DIR) if f.endswith(".json"))
        raise FileNotFoundError(f"no model config {path}; available: {names}")
    return path


def config_only_dir(name: str, out_dir: str, **overrides: Any) -> str:
    """An HF directory holding only ``config.json`` (from configs/models, with ``overrides``)."""
    with open(model_config_path(name)) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out_dir


def random_hf_model_dir(name: str, out_dir: str, *, seed: int, dtype: str, device: str, **overrides: Any) -> str:
    """Save a random-weight HF model of ``configs/models/<name>.json`` (+ overrides) to ``out_dir``.

    Weights are drawn on ``device`` in ``dtype`` ("bfloat16" | "float32") with the config's
    ``initializer_range`` (or the override) and saved as safetensors.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = config_only_dir(name, out_dir + ".cfg", **overrides)
    cfg = AutoConfig.from_pretrained(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    return out_dir


def layer_matmul_params(cfg: dict) -> int:
    """N_layer of the module docstring, from an HF config dict (qwen2/qwen3/llama; qwen3_moe: active params)."""
    h = int(cfg["hidden_size"])
    n_q = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_q)
    d = int(cfg.get("head_dim") or h // n_q)
    f = int(cfg["intermediate_size"])
    layers = int(cfg["num_hidden_layers"])
    attn = h * d * (2 * n_q + 2 * n_kv)
    if not cfg.get("num_experts"):
        return layers * (attn + 3 * h * f)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    moe_mlp = h * int(cfg["num_experts"]) + 3 * h * int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"])
    return layers * attn + sparse * moe_mlp + (layers - sparse) * 3 * h * f


def forward_flops(cfg: dict, seq_lens: Iterable[int], resp_lens: Iterable[int]) -> dict:
    """Forward FLOPs split into dense / attention / head (module docstring); lists of ints in."""
    seq_lens, resp_lens = list(seq_lens), list(resp_lens)
    h = int(cfg["hidden_size"])
    n_q = int(cfg["num_attention_heads"])
    d = int(cfg.get("head_dim") or h // n_q)
    layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    tokens = sum(seq_lens)
    dense = 2.0 * layer_matmul_params(cfg) * tokens
    attn = sum(2.0 * layers * n_q * d * s * s for s in seq_lens)
    head = 2.0 * h * vocab * sum(resp_lens)
    return {"dense": dense, "attention": attn, "head": head, "total": dense + attn + head, "tokens": tokens}


def step_flops(cfg: dict, seq_lens: list[int], resp_lens: list[int], *, update: bool, recompute: bool) -> dict:
    """Model FLOPs (for MFU) and hardware FLOPs (for HFU) of one update or one log-prob pass."""
    fwd = forward_flops(cfg, seq_lens, resp_lens)
    model = (3.0 if update else 1.0) * fwd["total"]
    hardware = ((4.0 if recompute else 3.0) if update else 1.0) * fwd["total"]
    return {"forward": fwd, "model_flops": model, "hardware_flops": hardware}
