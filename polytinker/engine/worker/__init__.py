"""The engine's worker processes and their contract with the scheduler.

- ``server``: a worker process: its ``WorkerPlan`` (what it is built from), ``WorkerServer`` (its
  Curve RPC server, registered with the scheduler), and the actors a runtime supervises
  (``EngineActor``, ``LearnerActor``); ``polytinker worker`` runs the same on another machine;
- ``messages``: what the scheduler asks of workers (``sched.w.*``: sample, forward_backward, step,
  save, load, export, ...), and what a worker sends it (``Register``);
- ``replies``: what workers answer (the ones a client gets are handed on unchanged);
- ``config``: how an engine and a learner group are configured (``[[engines]]``, ``[[learners]]``);
- ``layout``: where a worker keeps a job's weights (paths made from ids under its state root);
- ``auth``: how workers and their scheduler know each other (keys and proofs derived from the
  worker token).

The scheduler imports these; nothing in the engine imports the scheduler.
"""
