"""The model's shape from its ``config.json`` alone, and where that file is found.

Rule for finding the ``config.json`` of a dry run (first match wins):

1. ``--plan.model_config PATH``: a ``config.json`` file, or a directory holding one;
2. ``--actor.model_name_or_path DIR`` when ``DIR/config.json`` exists locally;
3. ``--actor.model_name_or_path demo``: ``configs/models/SmolLM2-135M-Instruct.json``;
4. ``configs/models/<basename of --actor.model_name_or_path>.json`` (the presets' cluster paths such as
   ``/models/Qwen3-32B`` do not exist on a laptop; their shapes ship with the repo).

Nothing else is read: no weights, no tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "configs" / "models"
DEMO_CONFIG = "SmolLM2-135M-Instruct.json"


def display_path(path: str | os.PathLike) -> str:
    """``path`` relative to the repository when it lies inside it (stable in generated docs)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def resolve_model_config(pretrain: str, override: str | None = None) -> Path:
    """The ``config.json`` the planner reads for ``--actor.model_name_or_path`` (see the module rule)."""
    if override:
        p = Path(override)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"--plan.model_config: {override} is neither a config.json nor a directory holding one")
        return p
    local = Path(pretrain) / "config.json"
    if pretrain != "demo" and local.is_file():
        return local
    name = DEMO_CONFIG if pretrain == "demo" else os.path.basename(os.path.normpath(pretrain)) + ".json"
    shipped = MODELS_DIR / name
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.json")))
    raise FileNotFoundError(
        f"--actor.model_name_or_path: {pretrain} has no local config.json and configs/models/{name} does not exist; "
        f"pass --plan.model_config PATH (a config.json) or use one of the shipped shapes: {known}"
    )


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of a dense decoder (Qwen3 / Qwen2 / Llama)."""

    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool  # Qwen2: biases on q/k/v
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model") -> "ModelShape":
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise NotImplementedError(
                f"{name}: a mixture-of-experts config ({cfg.get('model_type')}); the planner's memory and time terms "
                "are dense-only so far (experts, router and all-to-all terms: docs/moe.md); no estimate rather than a wrong one")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        mt = str(cfg.get("model_type", "llama"))
        return cls(
            name=name,
            model_type=mt,
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")) or mt == "qwen2",
            qk_norm=mt == "qwen3",
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelShape":
        with open(path) as f:
            cfg = json.load(f)
        stem = Path(path).stem if Path(path).name != "config.json" else Path(path).parent.name
        return cls.from_dict(cfg, name=stem)

    # ------------------------------------------------------------------ parameter counts
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer held by one TP rank (norm weights are replicated)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        split = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, proj, fc1 (gate+up), fc2
        if self.qkv_bias:
            split += q + 2 * kv
        replicated = 2 * h + (2 * self.head_dim if self.qk_norm else 0)  # two RMSNorms (+ q/k norms)
        return split // tp + replicated

    def embedding_params(self, tp: int = 1) -> int:
        return self.vocab * self.hidden // tp

    def stage_params(self, tp: int, pp: int, stage: int) -> int:
        """Parameters of pipeline stage ``stage`` on one TP rank: its layers, the embedding on the
        first stage, final norm + output layer on the last (tied embeddings with PP > 1 keep a
        second copy of the embedding on the last stage, as Megatron does)."""
        n = self.layers // pp * self.layer_params(tp)
        first, last = stage == 0, stage == pp - 1
        if first:
            n += self.embedding_params(tp)
        if last:
            n += self.hidden
            if not self.tied or not first:
                n += self.embedding_params(tp)
        return n

    def total_params(self) -> int:
        return self.stage_params(1, 1, 0)

    def kv_bytes_per_token(self, engine_tp: int, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token on one GPU of a vLLM engine (K and V of every layer); KV
        heads are replicated when the engine TP exceeds their count."""
        heads_per_gpu = max(1, self.kv_heads // engine_tp)
        return 2 * self.layers * heads_per_gpu * self.head_dim * dtype_bytes
