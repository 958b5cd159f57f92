"""The engine's worker processes and their contract with the scheduler.

- ``layout``: where a worker keeps a job's weights (paths made from ids under its state root);
- ``auth``: how workers and their scheduler know each other (keys and proofs derived from the
  worker token).

The scheduler imports these; nothing here imports the scheduler.
"""
