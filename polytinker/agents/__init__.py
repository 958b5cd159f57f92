"""polytinker.agents: agent specs, policy mapping, algorithms, the training loop.

Not built yet: see the agents and training loop issue.
"""

__all__: list[str] = []
