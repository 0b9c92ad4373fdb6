"""The subprocess rank launcher: ports drawn outside the kernel's and Ray's ranges, and a rendezvous
whose port another process took meanwhile (CI failed on this: EADDRINUSE at rank 0) retried on a new one."""
from __future__ import annotations

import os
import socket

import pytest

from openrlhf_shape.actor import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    for _ in range(20):
        port = launch.free_port()
        assert launch._PORT_RANGE[0] <= port <= launch._PORT_RANGE[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", launch.free_port()))
    s.listen(1)
    return s


def test_a_rendezvous_port_taken_meanwhile_is_retried_on_a_new_one(monkeypatch):
    held = _listening_socket()  # another process's server on the port the launcher drew
    drawn = iter([held.getsockname()[1]])
    real_free_port = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(drawn, None) or real_free_port(host))
    try:
        results = launch.run_ranks("launch_targets:rank_sum", 2, timeout=120, extra_pythonpath=[HERE])
    finally:
        held.close()
    assert results == [1, 1]


def test_a_port_taken_every_time_fails_with_the_ranks_logs(monkeypatch):
    held = _listening_socket()
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": held.getsockname()[1])
    try:
        with pytest.raises(launch.RankFailure, match="EADDRINUSE"):
            launch.run_ranks("launch_targets:rank_sum", 2, timeout=120, extra_pythonpath=[HERE])
    finally:
        held.close()
