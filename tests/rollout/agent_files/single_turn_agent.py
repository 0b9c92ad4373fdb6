"""A single-turn agent in OpenRLHF's agent interface (``AgentInstanceBase`` + ``MultiTurnAgentExecutor``, as
OpenRLHF's ``examples/python/agent_func.py``), written for these tests because that example does not ship with the
installed ``openrlhf`` package: one turn, no environment reply, reward 1 for an even number of characters."""

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        reward = torch.tensor(float(len(states["action_text"]) % 2 == 0))
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "sampling_params": states["sampling_params"], "extra_logs": {"even": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
