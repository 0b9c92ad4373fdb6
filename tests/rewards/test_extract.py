"""Answer extraction: last \\boxed{} with balanced braces and the documented fallbacks."""

import pytest

from openrlhf_shape.rewards.extract import (
    extract_answer,
    extract_final_answer_phrase,
    extract_last_boxed,
    extract_unclosed_boxed,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("\\fbox{7}", "7"),
        ("answer: \\boxed 5.", "5"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("no box here", None),
        ("\\boxed{12", None),  # unclosed: not a closed box
        ("\\boxedfoo{3}", None),  # another command name
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_unclosed_box_fallback_for_cut_probes():
    assert extract_unclosed_boxed("The final answer is $\\boxed{12") == "12"
    assert extract_unclosed_boxed("\\boxed{12}") is None
    assert extract_answer("\\boxed{3/4 $.") == ("3/4", "unclosed_boxed")


def test_final_answer_phrase_and_order():
    assert extract_final_answer_phrase("Thus the final answer is $42$.") == "42"
    assert extract_answer("the final answer is 7. \\boxed{8}") == ("8", "boxed")
    assert extract_answer("nothing") == (None, "none")


def test_pathological_inputs_are_linear():
    import time

    t = time.perf_counter()
    assert extract_last_boxed("\\boxed{" + "{" * 10000 + "}" * 10000 + "}") == "{" * 10000 + "}" * 10000
    assert extract_answer("\\frac{" * 40000)[1] in ("none", "final_answer_phrase")
    assert time.perf_counter() - t < 1.0
