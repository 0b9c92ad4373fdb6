"""Probe scoring that scales: the exact shortcuts agree with Math-Verify wherever they answer, and
the deduplicating scorer gives the plain pool's scores on the same completions (real Math-Verify),
including a real probe batch of the demo model (``data/demo_probe_batch.json``: 632 completions,
8 prompts x 4 responses, s_0 + entropy boundaries, m = 8, written by ``bench_rewards.py --probes``)."""

import itertools
import json
import os
import random
from fractions import Fraction

import pytest

from openrlhf_shape.rewards import MathVerifyScorer
from openrlhf_shape.rewards.fast_path import answer_value, fast_verdict, is_canonical_int, label_value
from openrlhf_shape.rewards.math_verify_pool import available_cores
from openrlhf_shape.rewards.probe_scoring import DedupProbeScorer

# Spellings where a string shortcut could go wrong: leading zeros, signs, separators, decimals,
# percent, fractions, big integers, scientific notation, whitespace.
TRICKY = [
    "0", "1", "01", "00", "-0", "+1", "-1", "-01", "1.0", "1.", "0.5", "1,000", "1000", "1 000", "10^3",
    "1e3", "\\frac{1}{2}", "\\frac12", "1/2", "50", "50\\%", "5000", "0.50", "12", "-12", "7",
    "123456789012345678901234567890", "123456789012345678901234567891", "1234567890123456789012345678901",
    "\\text{1}", "x=1", "1\\,000", "\\{1\\}", "(1)", "1^{1}", "\\sqrt{4}", "2",
]


@pytest.fixture(scope="module")
def pool():
    with MathVerifyScorer(num_workers=2, timeout_s=10.0) as s:
        yield s


def test_canonical_int_regex():
    assert [t for t in TRICKY if is_canonical_int(t)] == [
        "0", "1", "-1", "1000", "50", "5000", "12", "-12", "7",
        "123456789012345678901234567890", "123456789012345678901234567891", "2",
    ]


DECIMALS = ["10.9", "117.5", "-0.25", "0.5", "1.000001", "999999999.999999", "-12.1", "0.000001", "7.05"]
NOT_DECIDED_DECIMALS = ["117.0", "1.50", "1.0000001", "1234567890.5", "00.5", ".5", "1.", "+1.5"]


def test_fast_path_agrees_with_math_verify_on_every_pair_it_decides(pool):
    pairs = list(itertools.product(TRICKY + DECIMALS + NOT_DECIDED_DECIMALS, TRICKY))
    decided = [(a, b, fast_verdict(a, b)) for a, b in pairs]
    decided = [d for d in decided if d[2] is not None]
    # labels decided: the 12 canonical integers and "\frac{1}{2}"; against them the 14 simple
    # rationals (the integers, "\frac{1}{2}", "1/2"), and against the integer labels also the 10
    # non-integer decimals ("0.5" of TRICKY and DECIMALS; "0.50" ends in 0: not taken)
    ints = [t for t in TRICKY if is_canonical_int(t)]
    assert len(decided) == 14 * 13 + 10 * 12, len(decided)
    assert all(fast_verdict(a, "117") is None for a in NOT_DECIDED_DECIMALS)
    mv = pool.score(["\\boxed{" + a + "}" for a, _, _ in decided], [b for _, b, _ in decided])
    disagree = [(a, b, v, w) for (a, b, v), w in zip(decided, mv) if v != w]
    assert not disagree, disagree
    # only identical integer strings match, and "\frac{1}{2}" / "1/2" against "\frac{1}{2}"
    assert sum(v for _, _, v in decided) == 12 + 2
    assert ints
    # and the pairs the shortcut refuses include ones where string equality would be wrong
    assert fast_verdict("01", "1") is None and fast_verdict("1,000", "1000") is None
    assert fast_verdict("-0", "0") is None and fast_verdict("1.0", "1") is None
    assert fast_verdict("\\frac{1}{2}", "0.5") is None and fast_verdict(None, "1") is None


# Non-integer labels as the bundled maths set writes them, plus ones the shortcut must refuse.
FRACTION_LABELS = ["\\frac{7}{6}", "-\\frac{13}{28}", "\\frac{1}{2}", "-\\frac{3}{14}", "\\frac{1}{6}",
                   "\\frac{4}{2}", "\\frac{2}{4}", "\\frac{0}{3}", "\\frac{-3}{14}", "\\dfrac{1}{2}", "\\frac12",
                   "0.5", "1/2"]
FRACTION_ANSWERS = [
    "\\frac{7}{6}", "\\dfrac{7}{6}", "\\frac{14}{12}", "7/6", "14/12", "-7/6", "\\frac{-7}{6}", "\\frac{7}{-6}",
    "-\\frac{13}{28}", "-13/28", "\\frac{13}{28}", "-\\dfrac{26}{56}", "\\frac{1}{2}", "1/2", "2/4", "\\frac{2}{4}",
    "0.5", "0.50", "\\frac12", "\\tfrac{1}{2}", "1", "2", "0", "-1", "\\frac{4}{2}", "4/2", "2/1", "\\frac{2}{1}",
    "0/5", "-0/5", "\\frac{0}{3}", "1/0", "\\frac{1}{0}", "0.166667", "0.1666666", "\\frac{1}{6}", "1/6", "-3/14",
    "\\frac{3}{14}", "-\\frac{3}{14}", "1.1666666666666667", "01/2", "1/02", "1 / 2", "\\frac{ 7 }{ 6 }", "7 / 6",
    "\\frac{7}{6}.", "\\frac{7}{6}}", "117", "-26", "1/2/3",
]


def test_simple_rationals_are_parsed_conservatively():
    assert label_value("\\frac{7}{6}") == Fraction(7, 6) and label_value("-\\frac{13}{28}") == Fraction(-13, 28)
    assert label_value("117") == 117 and label_value("-26") == -26
    for refused in ("\\frac{4}{2}", "\\frac{2}{4}", "\\frac{0}{3}", "\\frac{-3}{14}", "\\dfrac{1}{2}", "\\frac12",
                    "0.5", "1/2", "01", "-0", "\\frac{7}{06}"):
        assert label_value(refused) is None, refused
    assert answer_value("\\dfrac{14}{12}") == Fraction(7, 6) and answer_value("-13/28") == Fraction(-13, 28)
    for refused in ("\\frac{-7}{6}", "1/0", "\\frac{1}{0}", "01/2", "1 / 2", "\\tfrac{1}{2}", "\\frac12", "1/2/3"):
        assert answer_value(refused) is None, refused


def test_fraction_shortcuts_agree_with_math_verify(pool):
    """Every (answer, label) pair the shortcuts decide among fraction spellings, integers and
    decimals against fraction and integer labels, compared with the pool's verdict."""
    labels = FRACTION_LABELS + ["1", "2", "0", "-1", "117", "-26"]
    pairs = list(itertools.product(FRACTION_ANSWERS + DECIMALS, labels))
    decided = [(a, b, fast_verdict(a, b)) for a, b in pairs]
    decided = [d for d in decided if d[2] is not None]
    mv = pool.score(["\\boxed{" + a + "}" for a, _, _ in decided], [b for _, b, _ in decided])
    disagree = [(a, b, v, w) for (a, b, v), w in zip(decided, mv) if v != w]
    assert not disagree, disagree
    assert len(decided) > 200 and 20 < sum(v for _, _, v in decided) < len(decided)
    # the refused pairs include ones where a value or string shortcut would be wrong
    refused = [("0.166667", "\\frac{1}{6}"), ("\\frac{-3}{14}", "-\\frac{3}{14}"), ("2", "\\frac{4}{2}"), ("x-x", "0")]
    assert all(fast_verdict(a, b) is None for a, b in refused)
    assert pool.score(["\\boxed{" + a + "}" for a, _ in refused], [b for _, b in refused]) == [1.0] * len(refused)


def test_dedup_scorer_equals_plain_pool_on_a_demo_probe_batch(pool):
    """A real probe batch of the demo model (malformed answers, 1.6% correct): same scores."""
    with open(os.path.join(os.path.dirname(__file__), "data", "demo_probe_batch.json")) as f:
        data = json.load(f)
    texts, labels = data["texts"], data["labels"]
    plain = pool.score(texts, labels)
    fast = DedupProbeScorer(pool)
    assert fast.score(texts, labels) == plain
    st = fast.last
    assert st.texts == len(texts) and st.unique < len(texts) and st.fast > 0 and st.pool > 0
    assert 0 < sum(plain) < len(plain)


def test_shortcut_refusals_matter(pool):
    """Math-Verify calls these equal although the strings differ (why the shortcut leaves them)."""
    got = pool.score(["\\boxed{01}", "\\boxed{1,000}", "\\boxed{-0}", "\\boxed{1.0}", "\\boxed{0.5}"],
                     ["1", "1000", "0", "1", "\\frac{1}{2}"])
    assert got == [1.0, 1.0, 1.0, 1.0, 1.0]


def _probe_like(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Texts shaped like probe completions ("\\boxed{" + 16 tokens), heavy repetition per label."""
    rng = random.Random(seed)
    labels_pool = ["12", "7", "-3", "\\frac{1}{6}", "-\\frac{3}{14}", "1000", "0", "\\frac{7}{6}"]
    texts, labels = [], []
    for _ in range(n):
        label = rng.choice(labels_pool)
        forms = [
            label + "}$.", label + "}$\n\nExplanation:", "12}", "13}$", "\\frac{1}{6}}$", "1/6}$", "0.5}$", "2/12}$",
            "\\dfrac{14}{12}}$", "-3/14}", "0.166667}$", "7/6",
            "01}$", "1,000}$", "-0}", "1.0}$", "\\dfrac{-3}{14}}$", "-3/14", "12", "the answer", "x = 7}",
            "7 + 5 = 12", "}", "", "6}\\boxed{7}", "\\frac{1}{6", "2", "3}$. So " + label,
        ]
        texts.append("\\boxed{" + rng.choice(forms))
        labels.append(label)
    return texts, labels


def test_dedup_scorer_equals_plain_pool(pool):
    texts, labels = _probe_like(600, seed=3)
    plain = pool.score(texts, labels)
    fast = DedupProbeScorer(pool)
    got = fast.score(texts, labels)
    assert got == plain
    st = fast.last
    assert st.texts == 600 and st.unique < 200 and st.fast > 0 and st.pool + st.fast == st.unique
    assert 0 < sum(plain) < len(plain)  # a mix of right and wrong answers, so equality is informative
    # without the integer shortcut: same scores, every distinct key through the pool
    dedup_only = DedupProbeScorer(pool, fast_path=False)
    assert dedup_only.score(texts, labels) == plain
    assert dedup_only.last.pool == st.unique and dedup_only.last.fast == 0


def test_cache_carries_verdicts_across_calls(pool):
    texts, labels = _probe_like(200, seed=5)
    scorer = DedupProbeScorer(pool)
    cache: dict = {}
    first = scorer.score(texts[:100], labels[:100], cache=cache)
    second = scorer.score(texts[100:], labels[100:], cache=cache)
    assert first + second == pool.score(texts, labels)
    assert scorer.last.cached > 0
    assert scorer.last.unique == scorer.last.cached + scorer.last.fast + scorer.last.pool


def test_pool_sized_to_available_cores():
    import os

    assert available_cores() == len(os.sched_getaffinity(0))
    with MathVerifyScorer(num_workers=0) as s:
        assert s.num_workers == available_cores()
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifyScorer(num_workers=-1)


def test_benchmark_batch_with_fewer_malformed_answers_keeps_the_demo_duplicate_structure():
    """bench_rewards.py's reduced-malformed batches: the same number of distinct keys and the same
    multiplicities, only the share that needs Math-Verify changes (at most the requested rate)."""
    import sys
    from collections import Counter

    from openrlhf_shape.rewards.probe_scoring import score_key

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from bench_rewards import _demo_keys_with_malformed_rate, _malformed_share

    with open(os.path.join(os.path.dirname(__file__), "data", "demo_probe_batch.json")) as f:
        data = json.load(f)
    texts, labels = data["texts"], data["labels"]

    def multiplicities(ts):
        return sorted(Counter(score_key(t, lab, 1 << 30)[0] for t, lab in zip(ts, labels)).values())

    before = _malformed_share(texts, labels)
    assert before > 0.2  # the demo model's forced answers: about a quarter need Math-Verify
    for rate in (0.05, 0.02, 0.0):
        new_texts, new_labels, got = _demo_keys_with_malformed_rate(texts, labels, rate)
        assert new_labels == labels and len(new_texts) == len(texts)
        assert got <= rate and abs(_malformed_share(new_texts, new_labels) - got) < 1e-12
        assert multiplicities(new_texts) == multiplicities(texts)
        assert rate == 0.0 or got > rate / 2  # the budget is used, not just respected
