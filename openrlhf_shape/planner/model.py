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
    """Architecture numbers of a decoder: dense (Qwen3 / Qwen2 / Llama) or mixture-of-experts (``qwen3_moe``).

    MoE fields (zero for dense models): ``num_experts`` routed experts per sparse layer, ``experts_per_tok``
    of them run per token (top-k), each a SwiGLU MLP of width ``moe_intermediate``; ``moe_layers`` lists
    the sparse layers (Hugging Face's rule: layer ``i`` is sparse unless it is in ``mlp_only_layers``, and
    ``(i + 1) % decoder_sparse_step == 0``); the other layers keep a dense MLP of width ``intermediate``.
    A sparse layer's router is a ``[num_experts, hidden]`` matrix; Qwen3-MoE has no shared expert.
    """

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
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model") -> "ModelShape":
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        mt = str(cfg.get("model_type", "llama"))
        layers = int(cfg["num_hidden_layers"])
        moe: dict[str, Any] = {}
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            if mt != "qwen3_moe":
                raise NotImplementedError(
                    f"{name}: a mixture-of-experts config of model_type {mt!r}; the planner sizes qwen3_moe only "
                    "(routed experts, no shared expert: docs/moe.md); no estimate rather than a wrong one")
            # the published configs say num_experts; transformers 5 writes num_local_experts (our HF exports too)
            cfg = {**cfg, "num_experts": cfg.get("num_experts") or cfg.get("num_local_experts")}
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if not cfg.get(key):
                    raise ValueError(f"{name}: qwen3_moe config without {key}; the planner cannot size its experts")
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense_only = {int(i) for i in (cfg.get("mlp_only_layers") or [])}
            moe = dict(num_experts=int(cfg["num_experts"]), experts_per_tok=int(cfg["num_experts_per_tok"]),
                       moe_intermediate=int(cfg["moe_intermediate_size"]),
                       moe_layers=tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0))
            if moe["experts_per_tok"] > moe["num_experts"]:
                raise ValueError(f"{name}: num_experts_per_tok {moe['experts_per_tok']} > num_experts {moe['num_experts']}")
        return cls(
            name=name,
            model_type=mt,
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")) or mt == "qwen2",
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            **moe,
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) holds routed experts instead of a dense MLP."""
        return layer in self.moe_layers

    def layer_params(self, tp: int = 1, layer: int | None = None) -> int:
        """Non-expert parameters of one decoder layer held by one TP rank (norm weights are replicated).

        Dense layer: attention + SwiGLU MLP (fc1 = gate+up, fc2), split by TP. Sparse layer (``layer`` in
        ``moe_layers``): attention + the router ``[num_experts, hidden]``, which Megatron keeps whole on every
        TP rank; the experts are :meth:`expert_layer_params`. ``layer=None``: a dense layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        sparse = layer is not None and self.is_sparse(layer)
        split = h * (q + 2 * kv) + q * h + (0 if sparse else 3 * h * i)  # qkv, proj, fc1 (gate+up), fc2
        if self.qkv_bias:
            split += q + 2 * kv
        replicated = 2 * h + (2 * self.head_dim if self.qk_norm else 0)  # two RMSNorms (+ q/k norms)
        if sparse:
            replicated += self.num_experts * h  # router
        return split // tp + replicated

    def expert_params_one(self) -> int:
        """Parameters of one expert: gate and up ``[I_moe, h]`` each, down ``[h, I_moe]``."""
        return 3 * self.hidden * self.moe_intermediate

    def expert_layer_params(self, etp: int = 1, ep: int = 1, layer: int | None = None) -> int:
        """Expert parameters of sparse layer ``layer`` on one rank: ``num_experts / ep`` local experts, each
        split ``etp`` ways (megatron-core's ``expert_tensor_parallel_size``); 0 for a dense layer."""
        if not self.is_moe or (layer is not None and not self.is_sparse(layer)):
            return 0
        return self.num_experts // ep * self.expert_params_one() // etp

    def stage_layers(self, pp: int, stage: int) -> range:
        n = self.layers // pp
        return range(stage * n, (stage + 1) * n)

    def embedding_params(self, tp: int = 1) -> int:
        return self.vocab * self.hidden // tp

    def stage_params(self, tp: int, pp: int, stage: int) -> int:
        """Non-expert parameters of pipeline stage ``stage`` on one TP rank: its layers, the embedding on the
        first stage, final norm + output layer on the last (tied embeddings with PP > 1 keep a
        second copy of the embedding on the last stage, as Megatron does). Experts: :meth:`stage_expert_params`."""
        n = sum(self.layer_params(tp, layer) for layer in self.stage_layers(pp, stage))
        first, last = stage == 0, stage == pp - 1
        if first:
            n += self.embedding_params(tp)
        if last:
            n += self.hidden
            if not self.tied or not first:
                n += self.embedding_params(tp)
        return n

    def stage_expert_params(self, etp: int, ep: int, pp: int, stage: int) -> int:
        """Expert parameters of pipeline stage ``stage`` on one rank (EP ``ep``, expert TP ``etp``)."""
        return sum(self.expert_layer_params(etp, ep, layer) for layer in self.stage_layers(pp, stage))

    def total_params(self) -> int:
        """Every parameter, all experts included (what the checkpoint and a vLLM engine hold)."""
        return self.stage_params(1, 1, 0) + self.stage_expert_params(1, 1, 1, 0)

    def expert_params(self) -> int:
        """All routed-expert parameters (0 for a dense model)."""
        return self.stage_expert_params(1, 1, 1, 0)

    def active_params(self) -> int:
        """Parameters one token runs through: the non-expert ones (router included) and ``experts_per_tok``
        experts per sparse layer; equals :meth:`total_params` for a dense model."""
        return self.stage_params(1, 1, 0) + len(self.moe_layers) * self.experts_per_tok * self.expert_params_one()

    def kv_bytes_per_token(self, engine_tp: int, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token on one GPU of a vLLM engine (K and V of every layer); KV
        heads are replicated when the engine TP exceeds their count."""
        heads_per_gpu = max(1, self.kv_heads // engine_tp)
        return 2 * self.layers * heads_per_gpu * self.head_dim * dtype_bytes
