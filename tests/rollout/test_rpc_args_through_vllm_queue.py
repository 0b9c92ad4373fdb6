"""Every argument the engines send their workers through ``collective_rpc``, on the path GPU engines at TP > 1 take.

vLLM 0.32's default Ray executor (RayExecutorV2, tests/contracts/test_vllm_gpu_contract.py) does not send RPC
arguments as Ray task arguments: ``collective_rpc`` (inherited from the multiprocessing executor) pickles
``(method, args, kwargs, output_rank)`` with PLAIN pickle into a shared-memory MessageQueue, which each worker
actor (RayWorkerProc) dequeues, dispatching to the worker's method; replies come back the same way. Workers on the
engine's node read the shared-memory ring, workers on other nodes a TCP socket. RayExecutorV2 needs GPUs, so here
its parts run on CPU in Ray actors as it arranges them: the engine side holds vLLM's executor code with the
broadcast queue RayExecutorV2 builds, each worker side vLLM's RayWorkerProc with the queues its own
``_init_message_queues`` builds and vLLM's busy loop, worker 0 on the engine's node (shared memory), worker 1 as if
on another node (TCP). The worker they dispatch to is our extension (rollout/worker_ext.py) on a host holding only
the worker's rank and device instead of vLLM's GPU worker.

What crosses: each transport's part of ``shape_init_receiver`` (Ray queue handles of the object-store and CUDA IPC
transports, the collective's rendezvous dict) and the sync id and timeout; back: each worker's rank and the
received buckets (tensors of several dtypes and sizes: in-band, out-of-band and over the ring's chunk size). The
queue handles must still work in the worker after plain pickle: the buckets a sender puts arrive bit for bit. A
generator (``shape_load_weights``'s argument) cannot cross, which is why ``VLLMEngine.load_weights`` refuses
anything but the in-process engine core.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from openrlhf_shape.actor.launch import free_port  # noqa: E402
from openrlhf_shape.weight_sync.base import get_or_raise, pack_bucket, put_or_raise  # noqa: E402
from openrlhf_shape.weight_sync.collective import Collective  # noqa: E402
from openrlhf_shape.weight_sync.cuda_ipc import CudaIpc  # noqa: E402
from openrlhf_shape.weight_sync.object_store import ObjectStore  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIMEOUT_S = 60.0


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    """Buckets whose tensors take each way through vLLM's queue: < 1 MiB pickled in band, >= 1 MiB out of band,
    over the 24 MiB ring chunk (the reply then goes through the overflow socket); bf16 has no numpy dtype."""
    gen = torch.Generator().manual_seed(0)
    return [
        [("model.norm.weight", torch.randn(64, generator=gen)), ("pos", torch.arange(7, dtype=torch.int64))],
        [("model.embed_tokens.weight", torch.randn(1024, 1024, generator=gen).to(torch.bfloat16)),
         ("mask", torch.rand(300, generator=gen) > 0.5)],
        [("lm_head.weight", torch.randn(25 * 2**18, generator=gen))],  # 25 MiB of float32
    ]


def _engine_side():
    @ray.remote(num_cpus=0)
    class EngineSide:
        """The engine actor's half: vLLM's RayExecutorV2 methods over the broadcast queue its _init_executor builds
        (``MessageQueue(world_size, n_local, max_chunk_bytes=..., connect_ip=...)``) and the reply queues it opens."""

        def __init__(self, world: int, n_local: int):
            from vllm import envs
            from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
            from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

            self.ex = RayExecutorV2.__new__(RayExecutorV2)
            self.ex.rpc_broadcast_mq = MessageQueue(world, n_local,
                                                    max_chunk_bytes=envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024,
                                                    connect_ip=ray.util.get_node_ip_address())
            self.ex.is_failed = False

        def broadcast_handle(self):
            return self.ex.rpc_broadcast_mq.export_handle()

        def connect(self, reply_handles: list) -> None:
            from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

            self.ex.response_mqs = [MessageQueue.create_from_handle(h, 0) for h in reply_handles]
            self.ex.rpc_broadcast_mq.wait_until_ready()
            for mq in self.ex.response_mqs:
                mq.wait_until_ready()
            self.ex.futures_queue = deque()

        def rpc(self, method, args: tuple) -> list:
            return self.ex.collective_rpc(method, args=tuple(args))

        def rpc_with_a_generator(self) -> str:
            try:
                self.ex.collective_rpc("shape_load_weights", args=((t for t in []),))
            except TypeError as e:
                return str(e)
            return "sent"

    return EngineSide


def _worker_side():
    @ray.remote(num_cpus=0)
    class WorkerSide:
        """One worker actor's half: vLLM's RayWorkerProc (its queues from its own _init_message_queues, its busy
        loop), dispatching to our worker extension on a host that holds the worker's rank and device."""

        def __init__(self, broadcast_handle, rank: int, on_engine_node: bool):
            from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

            from openrlhf_shape.rollout.worker_ext import WeightSyncExtension

            class ExtensionHost(WeightSyncExtension):
                def __init__(self, rank: int):
                    self.rank, self.device = rank, torch.device("cpu")

            self.proc = RayWorkerProc.__new__(RayWorkerProc)
            self.proc.worker, self.proc.rank = ExtensionHost(rank), rank
            self.proc._is_driver_node, self.proc.use_async_scheduling = on_engine_node, False
            self.proc._init_message_queues(broadcast_handle, None)

        def wait_for_init(self) -> dict:
            return self.proc.wait_for_init()

        def paths(self) -> tuple[bool, int]:
            """(reads the broadcast from shared memory, shared-memory readers of its replies)."""
            return self.proc.rpc_broadcast_mq._is_local_reader, self.proc.worker_response_mq.n_local_reader

        def run(self) -> None:
            self.proc.run()  # vLLM's busy loop until the actor is killed

    return WorkerSide


@pytest.fixture(scope="module")
def rpc_path(ray_local):
    engine = _engine_side().remote(2, 1)  # world 2, one worker on the engine's node
    handle = ray.get(engine.broadcast_handle.remote())
    worker_cls = _worker_side()
    workers = [worker_cls.remote(handle, 0, True), worker_cls.remote(handle, 1, False)]
    replies = ray.get([w.wait_for_init.remote() for w in workers], timeout=300)
    assert ray.get([w.paths.remote() for w in workers]) == [(True, 1), (False, 0)]  # shared memory; TCP both ways
    running = [w.run.remote() for w in workers]  # as RayExecutorV2: run() first, then the ready barrier
    ray.get(engine.connect.remote([r["handle"] for r in replies]), timeout=120)
    yield engine
    for actor in [engine, *workers]:
        ray.kill(actor)
    del running


def _drain():
    """A function vLLM cloudpickles to each worker (made here so that it travels by value, as a function of a module
    the workers cannot import must): what ``shape_receive`` streams into its reload, returned."""

    def drain(worker, sync_id: str) -> list:
        transport, state, timeout_s = worker._shape_receivers[sync_id]  # the class shape_init_receiver looked up
        return list(transport.stream(worker, state, timeout_s))

    return drain


def _assert_received(per_worker: list, buckets: list) -> None:
    sent = [t for bucket in buckets for t in bucket]
    assert len(per_worker) == 2
    for got in per_worker:
        assert [n for n, _ in got] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(got, sent):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_object_store_queue_handles_cross_and_carry_the_buckets(rpc_path):
    transport = ObjectStore([None], engine_tp=2, backend="gloo", timeout_s=TIMEOUT_S)
    try:
        sender_part, (part,) = transport.parts(None)
        assert ray.get(rpc_path.rpc.remote("shape_init_receiver", ("object_store", "os-1", part, TIMEOUT_S))) == [0, 1]
        received = rpc_path.rpc.remote(_drain(), ("os-1",))
        sender, buckets = ObjectStore.make_sender(sender_part, TIMEOUT_S), _buckets()
        sender.begin()
        for bucket in buckets:
            sender.send(bucket)
        sender.finish()
        _assert_received(ray.get(received, timeout=300), buckets)
    finally:
        transport.close()


def test_cuda_ipc_queue_and_ack_handles_cross(rpc_path):
    """The CUDA part itself needs a GPU (the kit's cuda_ipc section): here each worker takes one bucket message from
    the queue handle it received and acknowledges on the ack handle it received, as CudaIpc.stream does."""

    def take_and_ack(worker, sync_id: str):
        queue, ack = worker._shape_receivers[sync_id][1].inner  # (transport, Receiver(inner, progress), timeout)
        item = get_or_raise(queue, TIMEOUT_S, "queue")
        put_or_raise(ack, (worker.rank, item[0]), TIMEOUT_S, "acks")
        return item

    transport = CudaIpc([None], engine_tp=2, backend="nccl", timeout_s=TIMEOUT_S)
    try:
        sender_part, (part,) = transport.parts(None)
        assert ray.get(rpc_path.rpc.remote("shape_init_receiver", ("cuda_ipc", "ipc-1", part, TIMEOUT_S))) == [0, 1]
        items = rpc_path.rpc.remote(take_and_ack, ("ipc-1",))
        index, _ = pack_bucket(_buckets()[0], "cpu")
        message = (index, ("rebuild_cuda_tensor", (1, 2, 3)), "GPU-0000")  # what CudaIpcSender puts per bucket
        for q in sender_part["queues"]:
            put_or_raise(q, message, TIMEOUT_S, "queue")
        acks = [get_or_raise(a, TIMEOUT_S, "acks") for a in sender_part["acks"]]
        assert acks == [(0, index), (1, index)] and ray.get(items, timeout=120) == [message, message]
    finally:
        transport.close()


def test_collective_rendezvous_crosses_and_the_group_carries_the_buckets(rpc_path):
    from openrlhf_shape.weight_sync.collective import CollectiveSender

    host = ray.util.get_node_ip_address()
    group = {"host": host, "port": free_port(host), "world": 3, "backend": "gloo"}
    joined = rpc_path.rpc.remote("shape_init_receiver", ("collective", "c-1", {**group, "rank_offset": 1}, TIMEOUT_S))
    sender = Collective.make_sender(group, TIMEOUT_S)  # rank 0; returns when both workers joined
    assert isinstance(sender, CollectiveSender) and ray.get(joined, timeout=120) == [0, 1]
    received = rpc_path.rpc.remote(_drain(), ("c-1",))
    buckets = _buckets()
    sender.begin()
    for bucket in buckets:
        sender.send(bucket)
    sender.finish()
    _assert_received(ray.get(received, timeout=300), buckets)
    sender.close()


def test_a_generator_cannot_cross(rpc_path):
    assert "cannot pickle 'generator' object" in ray.get(rpc_path.rpc_with_a_generator.remote())
