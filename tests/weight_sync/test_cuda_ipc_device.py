"""CUDA IPC between a colocated rank and engine worker that number the GPUs differently: the handle
is opened on the receiver's index of the sender's GPU, matched by UUID (pure functions: no CUDA here;
the GPU kit runs the real two-process exchange)."""

from __future__ import annotations

import pytest

from openrlhf_shape.weight_sync.cuda_ipc import IPC_STORAGE_DEVICE_ARG, ipc_args_on_device, local_index_of_gpu


def test_receiver_opens_the_handle_on_its_own_index_of_the_senders_gpu() -> None:
    # the sender's process sees only GPU-c (index 0); the engine worker sees a, b, c, d
    visible = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    idx = local_index_of_gpu("GPU-c", visible)
    assert idx == 2
    args = tuple(range(15))  # rebuild_cuda_tensor's 15 positional arguments
    out = ipc_args_on_device(args, idx)
    assert out[IPC_STORAGE_DEVICE_ARG] == 2
    assert out[:IPC_STORAGE_DEVICE_ARG] == args[:IPC_STORAGE_DEVICE_ARG]
    assert out[IPC_STORAGE_DEVICE_ARG + 1:] == args[IPC_STORAGE_DEVICE_ARG + 1:]


def test_a_receiver_without_the_senders_gpu_is_told_which_transport_to_use() -> None:
    with pytest.raises(RuntimeError, match="not visible to this engine worker.*--rollout.weight_sync collective"):
        local_index_of_gpu("GPU-z", ["GPU-a", "GPU-b"])
