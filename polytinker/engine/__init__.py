"""polytinker.engine."""

from polytinker.engine.actors import Actor, ActorConfig, ActorRef, Supervisor, handler, spawn  # noqa: F401 (actors)
