"""Integrations with training frameworks, each importable without the framework installed (the framework is
imported when a name needs it): :mod:`.transformers` (Hugging Face experts implementation ``"cute_mxfp8"``) and
:mod:`.torchtitan` (``@override`` factories for ``FeedForward`` and ``GroupedExperts``)."""
