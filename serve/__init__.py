"""An OpenAI-compatible HTTP server in front of the engine: ``python -m serve``."""
