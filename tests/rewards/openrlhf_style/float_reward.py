"""OpenRLHF-style reward file (written for these tests): OpenRLHF calls reward_func with one sample,
so a bare float is a valid answer. Reward: the share of the response's characters that are
letters (in [0, 1]); a scalar extra log."""


def reward_func(queries, prompts, labels):
    response = queries[0][len(prompts[0]):]
    letters = sum(c.isalpha() for c in response)
    share = letters / max(len(response), 1)
    return {"rewards": share, "scores": float(share > 0.5), "extra_logs": {"letters": float(letters)}}
