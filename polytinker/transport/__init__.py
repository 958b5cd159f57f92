"""polytinker.transport."""
