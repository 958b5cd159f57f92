"""The engine's worker processes' contract with the scheduler.

- ``messages``: what the scheduler asks of workers (``sched.w.*``: sample, forward_backward, step,
  save, load, export, ...), and what a worker sends it (``Register``);
- ``replies``: what workers answer (the ones a client gets are handed on unchanged);
- ``config``: how an engine and a learner group are configured (``[[engines]]``, ``[[learners]]``);
- ``layout``: where a worker keeps a job's weights (paths made from ids under its state root);
- ``auth``: how workers and their scheduler know each other (keys and proofs derived from the
  worker token).

The scheduler imports these; nothing in the engine imports the scheduler.
"""
