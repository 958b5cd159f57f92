"""polytinker.scheduler: the central scheduler (jobs, queue policy, adapter placement).

Not built yet: see the scheduler issue. Importing works so that the package layout is stable.
"""

__all__: list[str] = []
