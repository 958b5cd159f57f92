"""polytinker.engine."""

from polytinker.engine.actors import Actor, ActorConfig, ActorRef, Supervisor, handler, spawn  # noqa: F401 (actors)
from polytinker.engine.models import DEFAULT_MODEL, TINY_RANDOM, ModelConfig, load_model, resolve_model  # noqa: F401 (models)
