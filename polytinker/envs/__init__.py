"""polytinker.envs."""
