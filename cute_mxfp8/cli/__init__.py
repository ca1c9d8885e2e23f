"""Command-line interface: ``python -m cute_mxfp8 {train,bench}``."""
