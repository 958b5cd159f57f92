"""polytinker.engine."""
