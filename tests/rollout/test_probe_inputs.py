"""Probe prompts are built in token space, bit-exact (no engine needed)."""

import pytest

from openrlhf_shape.rollout import ProbeConfig, ProbeSuffixes, build_probe_prompt


def test_suffixes_tokenised_once_and_think_end_known(tiny_tokenizer):
    cfg = ProbeConfig()
    suf = ProbeSuffixes.from_tokenizer(tiny_tokenizer, cfg)
    assert list(suf.think_ids) == tiny_tokenizer.encode(cfg.think_suffix, add_special_tokens=False)
    assert list(suf.answer_ids) == tiny_tokenizer.encode(cfg.answer_suffix, add_special_tokens=False)
    assert suf.think_end_id == tiny_tokenizer.convert_tokens_to_ids("</think>")
    assert suf.think_end_id in suf.think_ids and suf.think_end_id not in suf.answer_ids


def test_probe_prompt_is_exact_concatenation(tiny_tokenizer, chat_ids):
    suf = ProbeSuffixes.from_tokenizer(tiny_tokenizer, ProbeConfig())
    prompt = chat_ids("What is 1/2 + 1/4?")
    think_end = suf.think_end_id
    # a response that closes its thinking at position 7
    response = tiny_tokenizer.encode("let us add the fractions so we get", add_special_tokens=False)
    response = response[:6] + [think_end] + tiny_tokenizer.encode(" so \\frac{3}{4}", add_special_tokens=False)
    for b in range(0, len(response) + 1):
        probe = build_probe_prompt(prompt, response, b, suf)
        inside_think = think_end not in response[:b]
        expected = prompt + response[:b] + list(suf.think_ids if inside_think else suf.answer_ids)
        assert probe == expected  # bit-exact, the prefix is never re-tokenised
        assert probe[: len(prompt) + b] == prompt + response[:b]
    assert build_probe_prompt(prompt, response, 0, suf) == prompt + list(suf.think_ids)
    with pytest.raises(ValueError, match="boundary"):
        build_probe_prompt(prompt, response, len(response) + 1, suf)


def test_no_thinking_vocab_always_uses_answer_suffix():
    suf = ProbeSuffixes(think_ids=(9, 9, 4), answer_ids=(5, 6), think_end_id=None)
    assert build_probe_prompt([1, 2], [3, 4, 5], 2, suf) == [1, 2, 3, 4, 5, 6]
    assert build_probe_prompt([1, 2], [3, 4, 5], 0, suf) == [1, 2, 5, 6]


def test_probe_config_validation():
    with pytest.raises(ValueError, match="num_probes"):
        ProbeConfig(num_probes=0)
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeConfig(max_tokens=0)


def test_probe_query_is_the_whole_probe_sequence_decoded(tiny_tokenizer, chat_ids):
    """A reward function's query of a probe sample (rollout/probes.py:_ProbeQueries) equals decoding probe prompt +
    the sample's tokens at once, special tokens kept (as the answer's query), though each probe prompt is decoded
    once for its samples: tokens that split a character, special tokens and random ids right after the suffix."""
    import random

    from openrlhf_shape.rollout.probes import _ProbeQueries

    suf = ProbeSuffixes.from_tokenizer(tiny_tokenizer, ProbeConfig())
    prompt = chat_ids("Combien font 6 x 7 ? 😀")
    response = tiny_tokenizer.encode("On multiplie: 六 fois 七 … donc", add_special_tokens=False)
    requests = [build_probe_prompt(prompt, response, b, suf) for b in (0, 3, len(response) - 1)]
    calls = []
    queries = _ProbeQueries(lambda: calls.append(1) or tiny_tokenizer, requests)
    rng = random.Random(0)
    split_char = tiny_tokenizer.encode("😀七}$.", add_special_tokens=False)
    samples = [split_char, split_char[1:], [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")] + split_char,
               *[[rng.randrange(len(tiny_tokenizer)) for _ in range(8)] for _ in range(20)]]
    for state, request in enumerate(requests):
        for tokens in samples:
            want = tiny_tokenizer.decode(request + tokens, skip_special_tokens=False)
            assert queries.query(state, tokens) == want
    assert len(calls) == 1  # the tokenizer is fetched once, at the first query
