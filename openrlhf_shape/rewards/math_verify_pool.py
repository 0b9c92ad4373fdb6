"""Math-Verify scoring in worker processes with a hard deadline per verification.

Why processes: math-verify 0.9.0 uses signal.alarm (main thread only) and sympy can spin in C code
where no signal lands. Each worker handles one (response, label) at a time over a pipe; the parent
never uses signals, so ``score`` works from any thread, inside Ray actors and beside vLLM. A
verification that passes its deadline gets its worker killed (by pid) and replaced; a worker that
dies (crash) is replaced too. Both score 0 and are counted (``stats()``), never blocking the step.
Untrusted model output is capped to its last ``max_chars`` characters (the answer is at the end).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait

from openrlhf_shape.rewards.extract import extract_answer

# ---------------------------------------------------------------------------------------------------
# Worker side (runs in the child process)
# ---------------------------------------------------------------------------------------------------


def _as_latex(text: str) -> str:
    """Wrap a bare answer so Math-Verify's LaTeX extractor sees it (``\\frac12`` alone is not found)."""
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


GOLD_CACHE_SIZE = 4096  # parsed labels kept per worker


def verify_one(
    response: str, label: str, inner_timeout: int, gold_cache: dict | None = None
) -> tuple[float, str]:
    """(score, how) for one response against one gold label. Runs Math-Verify with its own signal
    timeouts (fine: a worker's main thread). how = extraction path or "unparsed".

    ``gold_cache`` (label -> parsed label) skips re-parsing a label seen before: ``parse`` is a
    deterministic function of its input and returns immutable sympy objects, so the verdict is the
    same; only successful parses are kept (a parse that timed out is retried next time)."""
    from math_verify import parse, verify

    gold = gold_cache.get(label) if gold_cache is not None else None
    if gold is None:
        gold = parse(_as_latex(label), parsing_timeout=inner_timeout)
        if gold and gold_cache is not None:
            if len(gold_cache) >= GOLD_CACHE_SIZE:
                gold_cache.clear()
            gold_cache[label] = gold
    if not gold:
        return 0.0, "bad_label"
    answer, how = extract_answer(response)
    if answer is not None:
        pred = parse(f"${answer}$", parsing_timeout=inner_timeout)
        if not pred:  # e.g. text answers; try Math-Verify's own search on the raw answer
            pred = parse(answer, parsing_timeout=inner_timeout)
    else:
        pred = parse(response, parsing_timeout=inner_timeout)
    if not pred:
        return 0.0, "unparsed"
    return (1.0 if verify(gold, pred, timeout_seconds=inner_timeout) else 0.0), how


class _InnerTimeoutCounter(logging.Filter):
    """Counts Math-Verify's own (swallowed) timeouts and keeps its huge warnings off the console."""

    count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Timeout during"):
            _InnerTimeoutCounter.count += 1
        return False


def _worker_main(conn, inner_timeout: int, cache_gold: bool = True) -> None:
    import math_verify  # noqa: F401  (import before the first job: keeps job latency flat)

    mv_logger = logging.getLogger("math_verify")
    mv_logger.addFilter(_InnerTimeoutCounter())
    for name in ("math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).addFilter(_InnerTimeoutCounter())
    # Warm-up before the first job: a number and a symbolic answer. The first symbolic comparison in a
    # process pays ~0.1 s of one-time set-up inside sympy's simplify (measured on 2 cores), which a
    # number alone does not trigger; without it, a step's first malformed probe answer per worker
    # carries that cost.
    for warm_answer in ("1", "x+1"):
        verify_one(f"\\boxed{{{warm_answer}}}", "1", inner_timeout)
    gold_cache: dict | None = {} if cache_gold else None
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        job_id, response, label = job
        try:
            before = _InnerTimeoutCounter.count
            score, how = verify_one(response, label, inner_timeout, gold_cache)
            if _InnerTimeoutCounter.count != before:
                how = "inner_timeout"
            conn.send((job_id, score, how, None))
        except BaseException as exc:  # noqa: BLE001 - report, never die silently
            conn.send((job_id, 0.0, "error", f"{type(exc).__name__}: {exc}"[:500]))


# ---------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    proc: mp.process.BaseProcess
    conn: object
    job: int | None = None
    started: float = 0.0


STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds


def _default_context() -> mp.context.BaseContext:
    # forkserver: a clean, single-threaded server process forks the workers, so restarts are cheap
    # and safe even when this process holds vLLM/torch threads (plain fork could deadlock). The
    # server preloads math_verify once (only takes effect if the forkserver is not running yet).
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["math_verify", "openrlhf_shape.rewards.math_verify_pool"])
    return ctx


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or Ray's share),
    not the machine's total."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # platforms without affinity masks
        return max(1, os.cpu_count() or 1)


class MathVerifyScorer:
    """score(responses, labels) -> [1.0 | 0.0] per pair, each verification under ``timeout_s``.

    ``num_workers=0`` sizes the pool to :func:`available_cores`. ``cache_gold=False`` re-parses the
    label for every pair (the behaviour before the label cache; benchmarks compare against it)."""

    def __init__(
        self,
        num_workers: int = 0,
        timeout_s: float = 5.0,
        max_chars: int = 20000,
        mp_context=None,
        cache_gold: bool = True,
    ):
        if num_workers < 0:
            raise ValueError(
                f"MathVerifyScorer.num_workers must be >= 1, or 0 for one per available core; got {num_workers}"
            )
        if num_workers == 0:
            num_workers = available_cores()
        if timeout_s <= 0:
            raise ValueError(f"MathVerifyScorer.timeout_s must be > 0 seconds, got {timeout_s}")
        if max_chars < 100:
            raise ValueError(f"MathVerifyScorer.max_chars must be >= 100, got {max_chars}")
        self.num_workers = num_workers
        self.cache_gold = bool(cache_gold)  # each worker keeps parsed labels (see verify_one)
        self.timeout_s = float(timeout_s)
        self.max_chars = int(max_chars)
        # Math-Verify's own (signal) limits inside the worker, parse + verify within the deadline.
        self._inner_timeout = max(1, int(math.floor(self.timeout_s / 2)))
        self._ctx = mp_context or _default_context()
        self._workers: list[_Worker] = []
        self._counts = {
            "verified": 0,
            "correct": 0,
            "timeouts": 0,
            "errors": 0,
            "crashes": 0,
            "truncated": 0,
            "unparsed": 0,
            "restarts": 0,
        }
        self._closed = False
        self._pid = os.getpid()

    # ---- workers -----------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self._inner_timeout, self.cache_gold),
                                 daemon=True)
        proc.start()
        child.close()
        # The deadline covers verification only: wait for the worker to finish its imports first.
        if not parent.poll(STARTUP_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"Math-Verify worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            msg = parent.recv()
        except EOFError as exc:
            raise RuntimeError("Math-Verify worker died while starting (is math-verify installed?)") from exc
        if not (isinstance(msg, tuple) and msg[0] == "ready"):
            raise RuntimeError(f"Math-Verify worker sent {msg!r} instead of its ready message")
        return _Worker(proc=proc, conn=parent)

    def _ensure_workers(self) -> None:
        if self._closed:
            raise RuntimeError("MathVerifyScorer is closed; create a new one")
        if os.getpid() != self._pid:  # used after a fork: the workers belong to the parent
            self._workers, self._pid = [], os.getpid()
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _kill(self, w: _Worker) -> None:
        try:
            w.conn.close()
        except OSError:
            pass
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)

    def _replace(self, idx: int) -> None:
        self._kill(self._workers[idx])
        self._workers[idx] = self._spawn()
        self._counts["restarts"] += 1

    # ---- scoring -----------------------------------------------------------------------------------
    def _cap(self, text: str) -> str:
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        if len(text) > self.max_chars:
            self._counts["truncated"] += 1
            return text[-self.max_chars :]
        return text

    def score(self, responses: list[str], labels: list[str]) -> list[float]:
        """[N] scores in {0.0, 1.0}. Each pair is verified under ``timeout_s`` (its worker is killed
        and replaced past that); timeouts and crashes score 0 and are counted."""
        if len(responses) != len(labels):
            raise ValueError(f"score: {len(responses)} responses but {len(labels)} labels")
        if not responses:
            return []
        self._ensure_workers()
        scores = [0.0] * len(responses)
        queue = deque(range(len(responses)))
        pending = 0
        # Hand out jobs; watch for results and deadlines.
        while queue or pending:
            for w in self._workers:
                if w.job is None and queue:
                    j = queue.popleft()
                    try:
                        w.conn.send((j, self._cap(responses[j]), self._cap(labels[j])))
                    except (BrokenPipeError, OSError):
                        queue.appendleft(j)
                        self._replace(self._workers.index(w))
                        continue
                    w.job, w.started = j, time.monotonic()
                    pending += 1
            now = time.monotonic()
            busy = [w for w in self._workers if w.job is not None]
            wait_s = min((w.started + self.timeout_s - now for w in busy), default=0.0)
            ready = mp_wait([w.conn for w in busy], timeout=max(0.0, wait_s)) if busy else []
            for i, w in enumerate(list(self._workers)):
                if w.job is None:
                    continue
                if w.conn in ready:
                    try:
                        job_id, score, how, err = w.conn.recv()
                    except (EOFError, OSError):  # the worker died mid-job (segfault, OOM kill, ...)
                        self._counts["crashes"] += 1
                        self._counts["errors"] += 1
                        w.job = None
                        pending -= 1
                        self._replace(i)
                        continue
                    scores[job_id] = float(score)
                    if err is not None:
                        self._counts["errors"] += 1
                    else:
                        self._counts["verified"] += 1
                        self._counts["correct"] += int(score > 0)
                        self._counts["unparsed"] += int(how == "unparsed")
                        self._counts["timeouts"] += int(how == "inner_timeout")
                    w.job = None
                    pending -= 1
                elif time.monotonic() - w.started >= self.timeout_s:
                    self._counts["timeouts"] += 1
                    w.job = None
                    pending -= 1
                    self._replace(i)
        return scores

    def stats(self) -> dict[str, int]:
        """Counts since construction: verified, correct, timeouts (Math-Verify's own limit or the hard
        deadline), errors (incl. crashes), crashes,
        truncated (inputs capped to max_chars), unparsed, restarts (workers replaced)."""
        return dict(self._counts)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            self._kill(w)
        self._workers = []

    def __enter__(self) -> "MathVerifyScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
