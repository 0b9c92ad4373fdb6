"""CPU (gloo) compatibility layer for megatron-core 0.16.1: every patch in one place.

megatron-core assumes CUDA in a few dozen spots (device literals, the CUDA RNG tracker,
``torch.cuda.synchronize``, ``param.type() == 'torch.cuda.FloatTensor'`` checks). When the
rank's platform profile (``openrlhf_shape/platform.py``, decided once by the driver) says CPU,
:func:`apply_cpu_patches` makes the *same* Megatron code run on CPU tensors with gloo. Under a GPU
profile it does nothing and nothing here is active.

Each patch says what breaks without it. The patches are process-wide and idempotent. The
TorchFunctionMode part is per thread: :func:`cpu_device_mode` must be entered in every thread that
runs Megatron code (the worker enters it around each public call).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.platform import Platform

_APPLIED = False
_LOCK = threading.Lock()


def _cuda_to_cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):
        # torch.cuda.current_device()-style ordinals passed as device=0.
        return "cpu"
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU inside Megatron code.

    Without it: ``torch.zeros(..., device="cuda")`` in the pipeline schedules, the optimizer's
    ``found_inf``/``_scale_one`` buffers and ``clip_grads`` raise "Torch not compiled with CUDA";
    ``Tensor.cuda()`` in the distributed optimizer and model wrapping raises the same; and
    ``param.type() == 'torch.cuda.FloatTensor'`` checks in the (distributed) optimizer reject every
    CPU float32 parameter ("Wrapped parameters must be one of torch.cuda.FloatTensor ...");
    ``pin_memory=True`` (the context-parallel RoPE slice) raises without an accelerator.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _cuda_to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            # pinned host memory needs an accelerator (megatron-core's CP RoPE slice asks for it)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_cuda_to_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Enter the CUDA->CPU TorchFunctionMode here unless already active (no-op unless the CPU
    patches were applied in this process, i.e. on GPU).

    The mode stack is per thread and the autograd engine does not carry it into backward, so
    code that re-runs forward code in backward (activation recompute) enters it again.
    """
    from torch.overrides import _get_current_function_mode_stack

    if not _APPLIED or any(isinstance(m, _CudaToCpuMode) for m in _get_current_function_mode_stack()):
        yield
        return
    with _CudaToCpuMode():
        yield


def _patch_torch_cuda() -> None:
    # Without it: every `device=torch.cuda.current_device()` (rotary embeddings, linear layers,
    # p2p shape exchange, grad buffers) raises "Torch not compiled with CUDA enabled".
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # Without it: p2p communication and DDP call torch.cuda.synchronize() and crash.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # Without it: model_parallel_cuda_manual_seed seeds the data-parallel state via CUDA and raises.
    # (The CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    # Without it: DDP/optimizer offload helpers call empty_cache and crash.
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]


class CpuRNGStatesTracker:
    """Megatron's named RNG-state tracker, backed by the CPU default generator.

    Without it: ``model_parallel_cuda_manual_seed`` and every ``get_cuda_rng_tracker().fork()``
    (weight init of TP-split layers, dropout in TP regions, activation recompute) read and write
    ``torch.cuda`` generator states and raise. States are ``torch.ByteTensor`` from
    ``torch.get_rng_state()``, so they are saved/restored in checkpoints like the CUDA ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} already registered in the CPU tracker")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} already registered in the CPU tracker")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} is not registered in the CPU tracker")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # `initialize_rng_tracker(force_reset=True)` would build a CUDA tracker again.
    orig_init = mrandom.initialize_rng_tracker

    def initialize_rng_tracker(*args: Any, **kwargs: Any) -> None:
        if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
        ):
            return
        orig_init(*args, **kwargs)

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # Without it: activation recompute (tensor_parallel.checkpoint) saves/restores the "CUDA" RNG
    # state around each recomputed block and raises "Torch not compiled with CUDA enabled".
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # Without it: the recomputed forward runs in backward, outside the CUDA->CPU mode, and hits
    # `torch.ones(..., device="cuda")` (default causal mask) -> "Torch not compiled with CUDA".
    ckpt_fn = mrandom.CheckpointFunction
    if not getattr(ckpt_fn.backward, "_shape_cpu_patched", False):
        orig_backward = ckpt_fn.backward

        def backward(ctx, *grads):
            with cpu_device_mode():
                return orig_backward(ctx, *grads)

        backward._shape_cpu_patched = True  # type: ignore[attr-defined]
        ckpt_fn.backward = staticmethod(backward)


def _patch_sequence_parallel_norm() -> None:
    """Sequence parallel with the torch RMSNorm fallback (no TE/Apex on CPU).

    Without it: ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch LayerNorm".
    The norm itself is pointwise over tokens, so it is correct on a sequence shard; what SP needs
    is that its weight grads are summed over the TP group, which ``finalize_model_grads`` does for
    parameters tagged ``sequence_parallel=True``. We build with the flag off and tag the weights.
    """
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_shape_cpu_patched", False):
        return
    orig_new = cls.__new__

    def __new__(klass, config, *args, **kwargs):  # noqa: N807
        sp = bool(config.sequence_parallel)
        if not sp:
            return orig_new(klass, config, *args, **kwargs)
        config.sequence_parallel = False
        try:
            module = orig_new(klass, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in module.parameters():
            p.sequence_parallel = True
        return module

    cls.__new__ = staticmethod(__new__)
    cls._shape_cpu_patched = True


def _patch_gloo_scatter() -> None:
    """gloo ``scatter`` garbles non-contiguous inputs (measured: wrong values, no error).

    Without it: any TP weight scatter of strided chunks (column chunks of a row-major tensor are
    views) silently loads wrong shard values and only a parity check notices. mbridge 0.15.1's
    ``load_weights`` already passes contiguous chunks; this guards every other caller.
    """
    import torch.distributed as dist

    if getattr(dist.scatter, "_shape_cpu_patched", False):
        return
    orig = dist.scatter

    def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, **kwargs):
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return orig(tensor, scatter_list, src=src, group=group, async_op=async_op, **kwargs)

    scatter._shape_cpu_patched = True  # type: ignore[attr-defined]
    dist.scatter = scatter


def _patch_distopt_adam_step_load() -> None:
    """Distributed-optimizer checkpoint load with torch's AdamW (the fallback without TE/Apex).

    torch AdamW keeps a per-parameter ``step`` tensor in its state; the reshardable loaders hand
    over only param/exp_avg/exp_avg_sq. Without it: ``KeyError: 'step'`` on load. We copy the keys
    that arrive and leave ``step`` alone; the checkpoint module then gives every parameter its own
    ``step`` equal to the saved step count (a shared or zero step makes resumed losses drift).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, "_shape_cpu_patched", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        missing = [k for k in dst if k not in tensors and k != "step"]
        if missing:
            raise KeyError(f"distributed optimizer checkpoint lacks state {missing}")
        for key, value in dst.items():
            if key in tensors:
                value.copy_(tensors[key])

    _set_main_param_and_optimizer_states._shape_cpu_patched = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _patch_moe_router_gemm() -> None:
    """megatron-core 0.16.1's MoE router gating reads ``te_general_gemm``, a name ``moe_utils`` binds only when
    transformer-engine imports; without TE every MoE forward raises ``NameError`` (its own code already
    falls back to a torch matmul when the name is None).

    Without it: a Qwen3-MoE model cannot run a forward on CPU (nor on a GPU without transformer-engine).
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe_alltoall_dispatcher() -> None:
    """The all-to-all MoE token dispatcher (expert parallelism) without CUDA streams.

    megatron-core 0.16.1's ``MoEAlltoAllTokenDispatcher`` overlaps the device-to-host copies of its split
    sizes with compute: its constructor creates a class-wide ``torch.cuda.Stream()`` and
    ``_maybe_dtoh_and_synchronize`` copies ``input_splits`` / ``output_splits`` / ``output_splits_tp`` to host
    numpy arrays on that stream, records an event and waits on it before the all-to-all. On CPU the tensors
    already live on the host, so the copy is the identity and no stream or event is needed; what must stay
    is the conversion of the split sizes to numpy at the same point (``all_to_all_single`` and the uneven
    TP all-gather take them as Python sequences, as on GPU).

    Without it: building any MoE layer with ``moe_token_dispatcher_type="alltoall"`` raises "torch.cuda.Stream
    requires CUDA support", so expert parallelism (which needs unequal token counts per rank: the all-gather
    dispatcher cannot do that) cannot run on CPU.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if getattr(MoEAlltoAllTokenDispatcher, "_shape_cpu_patched", False):
        return

    class _HostStream:
        """Stand-in for the class-wide DtoH stream: its presence keeps ``__init__`` from creating a CUDA one;
        nothing calls it (``_maybe_dtoh_and_synchronize`` below is the only user)."""

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()

    def _as_numpy(t: Any) -> Any:
        return t.numpy() if torch.is_tensor(t) else t

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Any = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = _as_numpy(self.input_splits)
            self.output_splits = _as_numpy(self.output_splits)
            self.output_splits_tp = _as_numpy(self.output_splits_tp)
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    MoEAlltoAllTokenDispatcher._shape_cpu_patched = True


def apply_cpu_patches(platform: "Platform") -> bool:
    """Apply all CPU patches once, only under a CPU profile (``platform``: the rank's, as handed).
    Returns True if active. The MoE router patch, which any machine without transformer-engine needs, is
    applied under every profile (found on an H200 without TE: every Qwen3-MoE forward raised NameError)."""
    global _APPLIED

    _patch_moe_router_gemm()  # not CPU-only: any machine without transformer-engine needs it (a no-op with TE)
    if not platform.on_cpu:
        return False
    with _LOCK:
        if _APPLIED:
            return True
        _patch_torch_cuda()
        _patch_rng_tracker()
        _patch_sequence_parallel_norm()
        _patch_gloo_scatter()
        _patch_distopt_adam_step_load()
        _patch_moe_router_gemm()
        _patch_moe_alltoall_dispatcher()
        _APPLIED = True
    return True
