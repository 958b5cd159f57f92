"""polytinker.engine: what runs on the accelerators.

- ``models``: the model presets and ``load_model``;
- ``inference``: inference engines (one base model, many LoRA adapters), and ``worker.py``, the
  engine process the runtime starts;
- ``learner``: LoRA and full-parameter learners, and ``worker.py``, the learner process the
  runtime starts;
- ``worker``: the workers' contract with the scheduler (messages, replies, configs, the layout of
  stored weights, authentication). The engine never imports the scheduler.
"""

from polytinker.engine.models import DEFAULT_MODEL, TINY_RANDOM, ModelConfig, load_model, resolve_model  # noqa: F401 (models)
