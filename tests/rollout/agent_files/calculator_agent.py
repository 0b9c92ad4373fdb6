"""A multi-turn agent in OpenRLHF's interface (written for these tests), with a deterministic environment: a
calculator tool that answers every call with the same fixed text. The policy's turn ends at the rollout's stop
string (the tool call); after ``TURNS`` turns the episode ends with a closing line. The reward is 1 when the last
turn's text has an even number of characters (random tiny models never solve anything; this gives groups with
reward variance, from the policy's own text only).
"""

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TOOL_REPLY = "\n<tool_response>\n42\n</tool_response>\n"
FINAL_REPLY = "\n[episode over]\n"
TURNS = 3


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        done = self.turn >= TURNS
        reward = torch.tensor([float(len(states["action_text"]) % 2 == 0)]) if done else torch.tensor([0.0])
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": FINAL_REPLY if done else TOOL_REPLY,
            "done": done,
            "sampling_params": states["sampling_params"],
            "extra_logs": {"tool_calls": torch.tensor([float(self.turn - int(done))])},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
