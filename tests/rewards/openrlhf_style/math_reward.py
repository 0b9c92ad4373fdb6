"""OpenRLHF-style maths reward file (written for these tests) that uses OpenRLHF's own answer
grader, so it only loads when the `openrlhf` package is installed."""

import torch
from openrlhf.utils.math_utils import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels):
    rewards, boxed = [], []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        answer = extract_boxed_answer(response)
        boxed.append(float(answer is not None))
        rewards.append(1.0 if answer is not None and grade_answer(answer, str(label)) else 0.0)
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"boxed_rate": torch.tensor(boxed)}}
