"""Built-in text games."""
