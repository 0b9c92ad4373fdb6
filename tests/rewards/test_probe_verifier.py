"""The probes' forced answers on the answer's reward path (``RewardComputer.score_probes``, issue 46): a reward
function judges them with OpenRLHF's arguments (query, prompt, label), its ``rewards`` on R's scale (clipped as R,
refused outside [0, 1]); an HTTP server gets them batched in bounded chunks, each distinct sample once; Math-Verify
keeps its probe cache and exact shortcuts. The engines' side (queries built from real probes, potentials) is
tests/rollout/test_probe_verifier_vllm.py."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openrlhf_shape.actor.launch import free_port
from openrlhf_shape.rewards import RewardComputer, RewardConfig
from openrlhf_shape.rewards.probe_scoring import ProbeAnswers

# OpenRLHF's own grader (tests/rewards/openrlhf_style/math_reward.py): a closed \boxed{} only, so a probe cut
# inside its box scores 0 where Math-Verify's extraction takes the unclosed box as the answer.
MATH_REWARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openrlhf_style", "math_reward.py")
PROMPT = "<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n"
SUFFIX = "Let me think.\n</think>\n\nThe final answer is $\\boxed{"
GENERATED = ["42}$.", "42", "41}$.", "42}$.", "42} because"]  # what each probe sample generated after the suffix


def _answers(generated: list[str], seen: list[int] | None = None) -> ProbeAnswers:
    """Probe samples of one state: keys are the generated text (the state is the same), queries prompt + suffix +
    text; ``seen`` records which samples' queries were built."""

    def query(j: int) -> str:
        if seen is not None:
            seen.append(j)
        return PROMPT + SUFFIX + generated[j]

    return ProbeAnswers(texts=["\\boxed{" + g for g in generated], labels=["42"] * len(generated),
                        prompts=[PROMPT] * len(generated), keys=[("reward", 0, g) for g in generated], query=query)


def test_probes_get_the_reward_functions_rewards_not_math_verifys():
    seen: list[int] = []
    with RewardComputer(RewardConfig(remote_url=MATH_REWARD, num_workers=1)) as rc:
        cache: dict = {}
        got = rc.score_probes(_answers(GENERATED, seen), cache=cache)
        # the reward function on OpenRLHF's arguments: the unclosed box (sample 1) is not an answer to it
        assert got == [1.0, 0.0, 0.0, 1.0, 1.0]
        direct = rc.compute([PROMPT + SUFFIX + g for g in GENERATED], [PROMPT] * 5, ["42"] * 5)["rewards"].tolist()
        assert got == direct
        assert sorted(seen) == [0, 1, 2, 4]  # sample 3 repeats sample 0 (same state and tokens): judged once
        # the same samples again (a later adaptive round of the step): the cache answers, nothing is sent
        assert rc.score_probes(_answers(GENERATED, seen), cache=cache) == got and sorted(seen) == [0, 1, 2, 4]
        # samples without identities: each is sent, the step's cache is left alone
        bare, seen[:] = _answers(GENERATED, seen), []
        bare.keys = None
        assert rc.score_probes(bare, cache=cache) == got and seen == [0, 1, 2, 3, 4] and len(cache) == 4
        # --probe.scorer math_verify: Math-Verify takes the unclosed box as the answer 42
        assert rc.score_probes(_answers(GENERATED), verifier="math_verify") == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_probe_rewards_are_clipped_as_r_and_refused_outside_the_unit_interval(tmp_path):
    f = tmp_path / "scaled.py"
    f.write_text("def reward_func(queries, prompts, labels, **kw):\n"
                 "    return {'rewards': [2.0 if q.endswith('}$.') else 0.5 for q in queries], 'scores': [0.0]}\n")
    with RewardComputer(RewardConfig(remote_url=str(f))) as rc:
        with pytest.raises(ValueError, match=r"reward 2\.0 .*\[0, 1\].*--probe\.scorer math_verify"):
            rc.score_probes(_answers(GENERATED))
    with RewardComputer(RewardConfig(remote_url=str(f), clip_range=(0.0, 1.0))) as rc:
        # R would be clamped to 1 by --reward.clip_range; so are the probes; rewards, not scores, are the values
        assert rc.score_probes(_answers(GENERATED)) == [1.0, 0.5, 1.0, 1.0, 0.5]


class _CountingHandler(BaseHTTPRequestHandler):
    """A reward server: 1 when the response after the prompt ends in a closed box; records every request."""

    requests: list[int] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(len(body["query"]))
        rewards = [float(q.startswith(p) and q.endswith("}$.")) for q, p in zip(body["query"], body["prompts"])]
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), _CountingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _CountingHandler.requests = []
    yield f"http://127.0.0.1:{port}/get_reward", _CountingHandler.requests
    server.shutdown()
    server.server_close()


def test_http_server_gets_the_probes_in_bounded_batches(reward_server):
    url, requests = reward_server
    generated = [f"{i % 30}}}$." if i % 3 else f"{i % 30}" for i in range(40)]  # 30 distinct samples
    with RewardComputer(RewardConfig(remote_url=url, remote_timeout_s=10)) as rc:
        cache: dict = {}
        got = rc.score_probes(_answers(generated), cache=cache)
        assert requests == [30]  # one request for the whole round, each distinct sample once
        assert got == [float(g.endswith("}$.")) for g in generated]
        rc.probe_chunk = 8  # bounded requests: ceil(30 / 8) of them
        assert rc.score_probes(_answers(generated)) == got
        assert requests == [30, 8, 8, 8, 6]
        assert rc.score_probes(_answers(generated), cache=cache) == got and len(requests) == 5  # all cached


def test_math_verify_probe_path_keeps_its_cache_and_exact_shortcuts():
    """No plug-in: the probes are Math-Verify's, through the deduplicating scorer (keys per extracted answer,
    integers decided without the pool)."""
    with RewardComputer(RewardConfig(num_workers=1, timeout_s=3.0)) as rc:
        cache: dict = {}
        got = rc.score_probes(_answers(GENERATED), cache=cache)
        assert got == [1.0, 1.0, 0.0, 1.0, 1.0]
        st = rc._probe_scorer.last
        assert st.texts == 5 and st.unique == 2 and st.fast == 2 and st.pool == 0
        assert set(cache) == {("answer", "42", "42"), ("answer", "41", "42")}
