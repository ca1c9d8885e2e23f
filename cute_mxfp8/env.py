"""On/off switches read from the environment (``CUTE_MXFP8_DISK_CACHE``, ``CUTE_MXFP8_PACKED_STORES``)."""

from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: 1/true/yes/on or 0/false/no/off (any case, surrounding spaces ignored); unset or empty:
    ``default``.  Anything else raises ValueError naming the variable: a typo must not silently mean on or off."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: set it to 1 (on) or 0 (off)")
