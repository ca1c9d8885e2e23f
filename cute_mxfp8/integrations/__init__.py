"""Integrations with training frameworks, each importable without the framework installed (the framework is
imported when a function needs it): :mod:`.transformers` (Hugging Face experts implementation)."""
