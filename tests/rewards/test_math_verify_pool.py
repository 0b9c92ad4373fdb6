"""Math-Verify in the worker pool: equivalences, wrong answers, deadlines on pathological inputs."""

import threading
import time

import pytest

from openrlhf_shape.rewards import MathVerifyScorer


@pytest.fixture(scope="module")
def scorer():
    with MathVerifyScorer(num_workers=2, timeout_s=3.0, max_chars=20000) as s:
        yield s


def test_equivalences_and_wrong_answers(scorer):
    cases = [
        ("The answer is \\boxed{0.5}", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("so we get $\\frac{1}{2}$", "0.5", 1.0),  # unboxed
        ("\\boxed{\\frac12}", "1/2", 1.0),
        ("\\boxed{2}", "\\frac12", 0.0),
        ("\\boxed{3}", "4", 0.0),
        ("I do not know", "4", 0.0),
        ("The final answer is $\\boxed{1/2", "0.5", 1.0),  # probe cut before the closing brace
        ("\\boxed{1} and later \\boxed{4}", "4", 1.0),  # last box wins
        ("\\boxed{4} and later \\boxed{1}", "4", 0.0),
    ]
    got = scorer.score([c[0] for c in cases], [c[1] for c in cases])
    assert got == [c[2] for c in cases]


def test_deadline_on_pathological_inputs_then_keeps_scoring():
    bad = [
        "\\boxed{" + "\\frac{" * 40000 + "}",  # ~200k characters of latex (capped to max_chars)
        "\\boxed{" + "{" * 10000 + "1" + "}" * 10000 + "}",  # 10k nested braces
        "".join(chr(c) for c in range(0x2000, 0x2000 + 5000)) * 4 + "\\boxed{\u2028\ufffd\U0001F600}",  # unicode junk
        "\\boxed{7^{7^{7^{7^{7}}}}}",  # big-number arithmetic in sympy
    ]
    timeout_s = 2.0
    with MathVerifyScorer(num_workers=2, timeout_s=timeout_s, max_chars=20000) as s:
        t0 = time.perf_counter()
        scores = s.score(bad, ["1"] * len(bad))
        elapsed = time.perf_counter() - t0
        assert scores == [0.0] * len(bad)
        # 4 items on 2 workers: at most two rounds of the deadline (no hang), plus restart slack
        assert elapsed < 2 * timeout_s + 10.0, elapsed  # slack: worker restarts on a loaded machine
        st = s.stats()
        assert st["truncated"] >= 1
        assert st["verified"] + st["timeouts"] + st["errors"] >= len(bad) - 0
        # still answers, and correctly, afterwards
        assert s.score(["\\boxed{0.5}", "\\boxed{3}"], ["\\frac12", "4"]) == [1.0, 0.0]


def test_hard_deadline_kills_a_stuck_worker_and_recovers():
    # A deadline below Math-Verify's own 1 s minimum alarm forces the parent to kill the worker.
    with MathVerifyScorer(num_workers=1, timeout_s=0.3) as s:
        s.score(["\\boxed{1}"], ["1"])  # warm the worker (import time is not part of the deadline)
        t0 = time.perf_counter()
        scores = s.score(["\\boxed{" + "{" * 10000 + "}" * 10000 + "}", "\\boxed{7^{7^{7^{7^{7}}}}}"], ["1", "2"])
        assert time.perf_counter() - t0 < 5.0
        assert scores == [0.0, 0.0]
        st = s.stats()
        assert st["timeouts"] >= 1 and st["restarts"] >= 1
        s.timeout_s = 30.0  # the replacement worker answers (generous: the CI machine may be loaded)
        assert s.score(["\\boxed{2}"], ["2"]) == [1.0]


def test_crash_scores_zero_and_is_counted():
    import os
    import signal

    with MathVerifyScorer(num_workers=1, timeout_s=5.0) as s:
        s.score(["\\boxed{1}"], ["1"])
        os.kill(s._workers[0].proc.pid, signal.SIGKILL)  # our own worker, by pid
        s._workers[0].proc.join(5)
        scores = s.score(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
        st = s.stats()
        assert st["restarts"] == 1  # the dead worker was replaced (on send or on a lost reply)
        # a lost reply scores 0 and counts as a crash; a failed send re-queues the job
        assert scores == ([0.0, 1.0] if st["crashes"] else [1.0, 1.0])
        assert s.score(["\\boxed{3}"], ["3"]) == [1.0]


def test_works_from_a_non_main_thread(scorer):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("s", scorer.score(["\\boxed{0.5}"], ["1/2"])))
    th.start()
    th.join(30)
    assert out["s"] == [1.0]


def test_length_mismatch_and_bad_config():
    with pytest.raises(ValueError, match="labels"):
        MathVerifyScorer(num_workers=1).score(["a"], [])
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyScorer(timeout_s=0)
