"""How much a sample's bf16 log-probs depend on the samples packed beside it (issue 35's unexplained KL).

OpenRLHF's DAPO and ProRL v2 scripts train in bf16 with packing and DAPO's dynamic filter. Their reference
log-probs come from the old-policy phase, where every sample of the step is packed into token-budget
micro-batches; the update packs only the groups the filter kept. The same weights then see the same sample
inside a packed row of another length: each matmul and attention runs over another number of rows and keys,
another blocking, so the fp32 accumulations round to other bf16 values. Result: a KL of ~1e-4 at a step whose
weights never moved (the recipe runs' step 2 after DAPO dropped every group of step 1), 0 with fp32 weights,
and exactly 0 in the agent scripts, whose filter kept every group (same packing in both passes).

This runs our DeepSpeed backend's policy module (HF model + chunked log-prob head, packed rows with
restarting position ids) on the CPU demo model, forward only, and compares the last four samples' response
log-probs packed with all eight vs packed alone; also the same packing twice and a grad vs no-grad pass (both
must be exactly equal: neither is the cause).

    python benchmarks/bf16_packing_context.py            # prints a JSON table, ~15 s on 2 cores
"""

from __future__ import annotations

import json

import torch

RESPONSE = 48  # response tokens per sample (the recipe runs: <= 64)
LENGTHS = [64, 95, 120, 70, 110, 88, 130, 60]  # prompt + response tokens of the eight samples
KEPT = [4, 5, 6, 7]  # the group the filter kept


def packed_logprobs(policy, seqs: list[torch.Tensor], idx: list[int], grad: bool = False) -> dict[int, torch.Tensor]:
    """Response log-probs ``[RESPONSE]`` of each sample in ``idx``, the samples packed into one ``[1, T]`` row."""
    ids = torch.cat([seqs[i] for i in idx])[None]
    pos = torch.cat([torch.arange(len(seqs[i])) for i in idx])[None]
    resp_pos, targets, ends, start = [], [], [], 0
    for i in idx:
        n = len(seqs[i])
        resp_pos += range(start + n - RESPONSE - 1, start + n - 1)  # the position that predicts each response token
        targets += seqs[i][n - RESPONSE:].tolist()
        ends.append(len(resp_pos))
        start += n
    with torch.enable_grad() if grad else torch.no_grad():
        lp, _ = policy(ids, pos, torch.zeros(len(resp_pos), dtype=torch.long), torch.tensor(resp_pos),
                       torch.tensor(targets))
    lp = lp.detach().float()
    return {i: lp[e - RESPONSE:e] for i, e in zip(idx, ends)}


def k3(log_ratio: torch.Tensor) -> float:
    """OpenRLHF's k3 estimator's mean over tokens, ``log_ratio`` = log pi_ref - log pi."""
    return float((torch.exp(log_ratio) - 1 - log_ratio).mean())


def measure(dtype: torch.dtype) -> dict[str, float]:
    from openrlhf_shape.data.demo_model import default_demo_model_dir
    from openrlhf_shape.zero.model import PolicyModule, load_hf_model

    model = load_hf_model(str(default_demo_model_dir()), dtype=dtype, attn_implementation="sdpa",
                          gradient_checkpointing=False)
    policy = PolicyModule(model, chunk_size=256).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    every = list(range(len(seqs)))
    with_all, alone = packed_logprobs(policy, seqs, every), packed_logprobs(policy, seqs, KEPT)
    alone_grad, again = packed_logprobs(policy, seqs, KEPT, grad=True), packed_logprobs(policy, seqs, every)
    reordered = packed_logprobs(policy, seqs, every[::-1])
    diff = torch.cat([with_all[i] - alone[i] for i in KEPT])
    return {"max |dlogp|, packed with all 8 vs the kept 4 alone": float(diff.abs().max()),
            "k3 KL, packed with all 8 vs alone": k3(diff),
            "max |dlogp|, all 8 in the reverse order": max(float((with_all[i] - reordered[i]).abs().max()) for i in every),
            "max |dlogp|, grad vs no-grad pass": max(float((alone[i] - alone_grad[i]).abs().max()) for i in KEPT),
            "max |dlogp|, the same packing twice": max(float((with_all[i] - again[i]).abs().max()) for i in every)}


def main() -> None:
    torch.manual_seed(0)
    print(json.dumps({str(dt): measure(dt) for dt in (torch.bfloat16, torch.float32)}, indent=1))


if __name__ == "__main__":
    main()
