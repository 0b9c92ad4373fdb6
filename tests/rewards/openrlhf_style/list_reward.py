"""OpenRLHF-style reward file (written for these tests): a plain list of rewards, no scores, no
extra_logs. Reward 1 when the response contains a digit."""


def reward_func(queries, prompts, labels):
    return {"rewards": [1.0 if any(c.isdigit() for c in q[len(p):]) else 0.0 for q, p in zip(queries, prompts)]}
