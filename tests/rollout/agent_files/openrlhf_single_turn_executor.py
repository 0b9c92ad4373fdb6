"""OpenRLHF's own single-turn executor with no reward endpoint: its episodes carry no reward, so the trainer's
reward function scores them (as OpenRLHF's reward model would)."""

from openrlhf.utils.agent import SingleTurnAgentExecutor


class AgentExecutor(SingleTurnAgentExecutor):
    def __init__(self):
        super().__init__(remote_rm_url=None)
