"""OpenRLHF-style reward file (written for these tests): tensor rewards and scores, extra_logs with
a tensor of per-sample values. Reward 1 when the response has an even number of characters."""

import torch


def reward_func(queries, prompts, labels):
    lengths = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
    rewards = (lengths % 2 == 0).float()
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"response_chars": lengths, "even": rewards.mean()}}
