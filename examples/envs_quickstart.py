"""Drive text games with the episode coordinator, the way a training loop does.

    python examples/envs_quickstart.py

``learner`` stands in for an LLM-backed policy: it receives a ``PolicyInput`` (instructions,
observation, the agent's own history), builds the chat messages a model would see, and answers
with an ``AgentAction`` whose ``meta`` ends up in the trajectory. Here it answers by a trivial
rule; a real one awaits its inference service.
"""

from __future__ import annotations

import asyncio

from polytinker.envs import AgentAction, Coordinator, CoordinatorConfig, PolicyInput, make, scripted_policy


async def learner(agent: str, inp: PolicyInput) -> AgentAction:
    messages = inp.to_messages()
    await asyncio.sleep(0)  # an inference call would be awaited here
    legal = inp.observation.legal_moves
    text = legal[len(legal) // 2] if legal else "walk away"
    return AgentAction(text, meta={"num_messages": len(messages)})


async def main() -> None:
    coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=32))
    for env_id in ("tictactoe-v0", "kuhn_poker-v0", "prisoners_dilemma-v0", "negotiation-v0"):
        env = make(env_id)
        learner_agent, opponent = env.possible_agents
        policies = {learner_agent: learner, opponent: scripted_policy(env, "heuristic", seed=0)}
        results = await coordinator.run(lambda env_id=env_id: make(env_id), policies, range(100), env_id=env_id)
        mean = sum(r.total_rewards[learner_agent] for r in results) / len(results)
        turns = sum(len(r.trajectories[learner_agent].turns) for r in results)
        print(f"{env_id:22s} mean reward of {learner_agent} vs heuristic: {mean:+.2f} over {turns} decisions")
    first = results[0].trajectories[learner_agent].turns[0]
    print("\nfirst observation of the last game:\n" + first.observation.text)
    print(f"action: {first.action!r}, reward: {first.reward:+.2f}, meta: {dict(first.meta)}")


if __name__ == "__main__":
    asyncio.run(main())
