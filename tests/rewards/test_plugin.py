"""The OpenRLHF reward plug-in: local .py reward_func and an HTTP endpoint (real local server)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from openrlhf_shape.actor.launch import free_port
from openrlhf_shape.rewards import RewardComputer, RewardConfig, RewardPluginError, load_reward_fn

PLUGIN = '''
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [1.0 if q.strip().endswith(l) else 0.0 for q, l in zip(queries, labels)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"n": float(len(queries))}}
'''

RAISING = '''
def reward_func(queries, prompts, labels, **kwargs):
    for q in queries:
        if "boom" in q:
            raise ValueError("cannot score this one")
    return {"rewards": [0.0] * len(queries)}
'''


def test_local_py_plugin(tmp_path):
    f = tmp_path / "rm.py"
    f.write_text(PLUGIN)
    fn = load_reward_fn(str(f))
    out = fn(["p a 3", "p b 4"], ["p", "p"], ["3", "5"])
    # called once per sample, as OpenRLHF does: each call sees one query
    assert out["rewards"] == [1.0, 0.0] and out["extra_logs"] == {"n": [1.0, 1.0]}
    with RewardComputer(RewardConfig(remote_url=str(f))) as rc:
        res = rc.compute(["p a 3", "p b 4"], ["p", "p"], ["3", "5"])
    assert torch.equal(res["rewards"], torch.tensor([1.0, 0.0])) and res["scores"].dtype == torch.float32


def test_plugin_that_raises_names_the_prompt_index(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(RAISING)
    fn = load_reward_fn(str(f))
    with pytest.raises(RewardPluginError, match=r"prompt index 2.*|.*prompt index 2"):
        fn(["ok", "fine", "boom here", "ok"], ["a", "b", "c", "d"], ["1"] * 4)


def test_bad_plugin_files(tmp_path):
    with pytest.raises(RewardPluginError, match="file not found"):
        load_reward_fn(str(tmp_path / "missing.py"))
    f = tmp_path / "nofunc.py"
    f.write_text("x = 1\n")
    with pytest.raises(RewardPluginError, match="defines no reward_func"):
        load_reward_fn(str(f))
    g = tmp_path / "wrong.py"
    g.write_text("def reward_func(q, p, l, **kw):\n    return {'rewards': [1.0, 0.0]}\n")
    with pytest.raises(RewardPluginError, match=r"one number per sample \(1\), got 2"):
        load_reward_fn(str(g))(["a", "b"], ["a", "b"], ["1", "2"])
    with pytest.raises(RewardPluginError, match="neither an http"):
        load_reward_fn("rm.txt")


class _Handler(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802
        _Handler.calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if _Handler.calls == 1:  # first call fails with a server error: the client must retry
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"warming up")
            return
        rewards = [float(len(q) % 2) for q in body["query"]]
        data = json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_http_plugin_with_retry_and_down_endpoint():
    port = free_port()
    server = HTTPServer(("127.0.0.1", port), _Handler)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        fn = load_reward_fn(f"http://127.0.0.1:{port}/score", timeout_s=5, retries=2, backoff_s=0.05)
        out = fn(["ab", "abc"], ["", ""], ["x", "y"])
        assert out["rewards"] == [0.0, 1.0] and _Handler.calls == 2
    finally:
        server.shutdown()
        server.server_close()
    down = load_reward_fn(f"http://127.0.0.1:{port}/score", timeout_s=1, retries=1, backoff_s=0.05)
    with pytest.raises(RewardPluginError, match=rf"127.0.0.1:{port}/score unreachable.*remote_retries 1"):
        down(["a"], ["a"], ["1"])


def test_reward_computer_math_verify_strips_prompt():
    with RewardComputer(RewardConfig(num_workers=1, timeout_s=3.0)) as rc:
        res = rc.compute(
            ["Q: 1/2? A: \\boxed{0.5}", "Q: 2+2? \\boxed{4} A: \\boxed{5}"],
            ["Q: 1/2? A:", "Q: 2+2? \\boxed{4}"],  # the prompt's own box must not count
            ["\\frac12", "4"],
        )
    assert res["rewards"].tolist() == [1.0, 0.0]
    assert set(res["extra_logs"]) >= {"reward/timeouts", "reward/errors"}
