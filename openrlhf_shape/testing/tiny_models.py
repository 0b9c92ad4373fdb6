"""Tiny random Qwen3 / Qwen2 / Llama checkpoints with a real (locally trained) BPE tokenizer.

Every test that needs a model builds one here from a config: no hub access. The tokenizer is a
byte-level BPE trained in about a second on a generated maths corpus, with ChatML and
``<think>``/``</think>`` special tokens, so chat templates, probe suffixes and Math-Verify scoring
all see realistic text. Shapes are chosen for the CPU: head_dim 32 (accepted by vLLM's CPU
attention), vocab 1024 (vocab dominates CPU cost).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

TINY_ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML; Qwen3-style thinking models open the assistant turn inside <think>.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = (
        "the answer is so we get then let compute find value of sum product number equation "
        "solve thus therefore wait check time up stop thinking final boxed step first second "
        "because since total each add subtract multiply divide fraction square root prime"
    ).split()
    latex = [r"\frac{1}{2}", r"\boxed{", r"\sqrt{2}", r"x^2", r"\cdot", r"\pi", r"$", r"\dfrac{3}{4}", "}"]
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 14)):
            r = rng.random()
            if r < 0.55:
                parts.append(rng.choice(words))
            elif r < 0.8:
                parts.append(str(rng.randint(0, 999)))
            else:
                parts.append(rng.choice(latex))
        lines.append(" ".join(parts) + rng.choice([".", "\n\n", "\n", " ="]))
    lines.append("Time is up. I should stop thinking and give the final answer now.")
    lines.append("The final answer is $\\boxed{")
    return lines


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer and save it (HF fast tokenizer files) into ``out_dir``.

    Returns the loaded ``PreTrainedTokenizerFast``. Deterministic for a given ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def _config(arch: str, vocab_size: int, num_layers: int, tie: bool | None, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.05,
        dtype="float32",
    )
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=32, tie_word_embeddings=bool(tie) if tie is not None else False, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=bool(tie) if tie is not None else False, **common)
    elif arch == "qwen3_moe":  # 8 experts, 2 routed per token, every layer sparse (as Qwen3-30B-A3B: 128 / 8)
        cfg = Qwen3MoeConfig(head_dim=32, tie_word_embeddings=bool(tie) if tie is not None else False, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                             norm_topk_prob=True, router_aux_loss_coef=0.001, **common)
    elif arch == "llama":
        cfg = LlamaConfig(head_dim=32, tie_word_embeddings=True if tie is None else bool(tie), **common)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    num_layers: int = 2,
    vocab_size: int = 1024,
    tie_word_embeddings: bool | None = None,
    **config_overrides,
) -> Path:
    """Write a random tiny ``arch`` model + tokenizer as an HF directory; return its path.

    ``arch``: ``qwen3`` (q/k norm), ``qwen2`` (q/k/v bias), ``llama`` (tied embeddings by default,
    like SmolLM2). Weights are float32, drawn with ``torch.manual_seed(seed)``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out, vocab_size=vocab_size)
    cfg = _config(arch, vocab_size, num_layers, tie_word_embeddings, **config_overrides)
    cfg.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
