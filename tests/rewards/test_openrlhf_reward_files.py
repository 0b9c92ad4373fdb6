"""Reward files in OpenRLHF 0.11's style (tests/rewards/openrlhf_style/, written by us) load and score
unchanged: tensor / list / float rewards, optional scores, extra_logs as tensors or scalars (logged as
means, and the metrics file stays valid JSON), a file importing ``openrlhf.utils.math_utils``, and
several HTTP endpoints given comma-separated (sharded, rotated, a dead one skipped, timeout flag)."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from openrlhf_shape.actor.launch import free_port
from openrlhf_shape.rewards import RewardComputer, RewardConfig, RewardPluginError, load_reward_fn
from openrlhf_shape.trainer.logging_utils import MetricsLogger

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openrlhf_style")
PROMPTS = ["<p>", "<p>", "<q>"]
QUERIES = ["<p>ab", "<p>x 7", "<q>\\boxed{4}."]  # responses "ab" (2 chars), "x 7" (3), "\boxed{4}." (10)
LABELS = ["1", "7", "4"]


def _compute(name: str) -> dict:
    with RewardComputer(RewardConfig(remote_url=os.path.join(HERE, name), num_workers=1)) as rc:
        return rc.compute(QUERIES, PROMPTS, LABELS)


def test_tensor_rewards_with_tensor_extra_logs(tmp_path):
    out = _compute("tensor_reward.py")
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0] and out["scores"].tolist() == [1.0, 0.0, 1.0]
    # per-sample tensors are averaged over the batch: mean response length (2 + 3 + 10) / 3
    assert out["extra_logs"]["reward/response_chars"] == pytest.approx(5.0)
    assert out["extra_logs"]["reward/even"] == pytest.approx(2 / 3)
    # the metrics file takes them (a raw tensor used to break JSON logging), and tensors left in a
    # metrics dict are written as numbers / lists
    logger = MetricsLogger(str(tmp_path), {"name": "t"})
    logger.log(1, {**out["extra_logs"], "raw/tensor": torch.tensor([1.0, 2.0]), "raw/scalar": torch.tensor(3.0)})
    logger.close()
    row = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert row["reward/response_chars"] == pytest.approx(5.0)
    assert row["raw/tensor"] == [1.0, 2.0] and row["raw/scalar"] == 3.0


def test_list_rewards_without_scores():
    out = _compute("list_reward.py")
    assert out["rewards"].tolist() == [0.0, 1.0, 1.0]
    assert torch.equal(out["scores"], out["rewards"]) and out["extra_logs"] == {}


def test_bare_float_rewards_per_sample():
    out = _compute("float_reward.py")
    assert out["rewards"].tolist() == pytest.approx([1.0, 1 / 3, 5 / 10])
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out["extra_logs"]["reward/letters"] == pytest.approx((2 + 1 + 5) / 3)


def test_file_importing_openrlhf_math_utils_loads_and_grades():
    import openrlhf.utils.math_utils  # the real package (installed with --no-deps)

    assert openrlhf.utils.math_utils.grade_answer("0.5", "\\frac{1}{2}")
    out = _compute("math_reward.py")
    assert out["rewards"].tolist() == [0.0, 0.0, 1.0]
    assert out["extra_logs"]["reward/boxed_rate"] == pytest.approx(1 / 3)


def test_non_numeric_extra_log_is_refused_naming_the_key(tmp_path):
    f = tmp_path / "scalar.py"
    f.write_text("def reward_func(q, p, l):\n    return {'rewards': 0.5, 'extra_logs': {'k': 'text'}}\n")
    with pytest.raises(RewardPluginError, match=r"extra_logs\['k'\] must be a number, a tensor or a list"):
        load_reward_fn(str(f))(["a"], ["a"], ["1"])


# ------------------------------------------------------------------------------------------ HTTP


def _server(tag: float, delay_s: float = 0.0):
    seen: list[list[str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(list(body["query"]))
            time.sleep(delay_s)
            n = len(body["query"])
            data = json.dumps({"rewards": [tag] * n, "extra_logs": {"server": [tag] * n}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    port = free_port()
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{port}/get_reward", seen


def test_comma_separated_endpoints_shard_rotate_and_skip_a_dead_one():
    a, url_a, seen_a = _server(0.25)
    b, url_b, seen_b = _server(0.75)
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    try:
        fn = load_reward_fn(f"{url_a}, {url_b}", timeout_s=5, retries=0)
        out = fn(["q0", "q1", "q2", "q3"], ["", "", "", ""], ["", "", "", ""])
        # two shards of two, one per endpoint, in order
        assert sorted(map(tuple, seen_a + seen_b)) == [("q0", "q1"), ("q2", "q3")]
        assert out["rewards"] in ([0.25, 0.25, 0.75, 0.75], [0.75, 0.75, 0.25, 0.25])
        # rotation across calls: a one-sample call goes to the next endpoint each time
        seen_a.clear(), seen_b.clear()
        for i in range(4):
            fn([f"s{i}"], [""], [""])
        assert len(seen_a) == 2 and len(seen_b) == 2
        # a dead endpoint in the list: the failed attempt moves on to a live one
        with RewardComputer(RewardConfig(remote_url=f"{dead},{url_a}", remote_timeout_s=5, remote_retries=1)) as rc:
            res = [rc.compute(["z"], [""], [""]) for _ in range(2)]
        assert all(r["rewards"].tolist() == [0.25] for r in res)
        assert res[0]["extra_logs"] == {"reward/server": 0.25}
    finally:
        for s in (a, b):
            s.shutdown()
            s.server_close()


def test_remote_timeout_flag_applies():
    slow, url, _ = _server(1.0, delay_s=2.0)
    try:
        fn = load_reward_fn(url, timeout_s=0.3, retries=0)
        with pytest.raises(RewardPluginError, match=r"timed out.*remote_timeout_s 0.3"):
            fn(["q"], [""], [""])
        assert load_reward_fn(url, timeout_s=5, retries=0)(["q"], [""], [""])["rewards"] == [1.0]
    finally:
        slow.shutdown()
        slow.server_close()
    with pytest.raises(RewardPluginError, match="must be the only entry"):
        load_reward_fn(f"{os.path.join(HERE, 'list_reward.py')},{url}")
