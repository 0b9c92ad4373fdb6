"""The reference model's checks on a rank worker of either backend (tests/megatron, tests/zero run them inside
their rank processes)."""

from __future__ import annotations

from openrlhf_shape.testing.batches import train_batches


def reference_run(worker, hf_dir: str, batch: dict) -> dict:
    """The reference model on these ranks (either backend): its description, its log-probs of ``batch``, what an
    offload of the gradients and optimizer states moves (nothing: it has none) and of the parameters, the log-probs
    after onloading them again, and why ``train_step`` is refused."""
    out = {"info": worker.init_reference(hf_dir), "logprobs": worker.compute_logprobs_and_entropy(batch)}
    out["offload_grads_optimizer"] = worker.offload_states(("grads", "optimizer"))
    out["offload"] = worker.offload_states(("params",))
    out["onload"] = worker.onload_states(("params", "grads", "optimizer"))
    out["after_onload"] = worker.compute_logprobs_and_entropy(batch)
    try:
        worker.train_step(train_batches(batch, 1, seed=5)[0])
        out["train_refused"] = ""
    except RuntimeError as exc:
        out["train_refused"] = str(exc)
    return out
