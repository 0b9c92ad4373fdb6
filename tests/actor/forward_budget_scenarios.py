"""Rank side of tests/actor/test_forward_token_budget.py (run in a subprocess by ``launch.run_ranks``): one
backend's real rank worker computes the same batch's log-probs under several forward token budgets."""

from __future__ import annotations

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.rank_configs import megatron_config, replaced, zero_config


def forward_budgets(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str, cfg: dict,
                    model_dir: str, batch: dict, budgets: list) -> dict:
    """``{budget: compute_logprobs_and_entropy(batch)}`` with ``forward_max_tokens = budget`` (None: the training
    budget ``cfg["micro_batch_max_tokens"]``), on one worker."""
    if backend == "megatron":
        from openrlhf_shape.megatron.worker import MegatronRankWorker as Worker

        rank_cfg = megatron_config(cfg)
    else:
        from openrlhf_shape.zero.worker import ZeroRankWorker as Worker

        rank_cfg = zero_config(cfg)
    worker = Worker(rank_cfg, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                    platform=detect_platform())
    worker.init_model(model_dir)
    out = {}
    for budget in budgets:
        worker.cfg = replaced(rank_cfg, forward_max_tokens=budget)
        out[budget] = worker.compute_logprobs_and_entropy(batch)
    worker.shutdown()
    return out
