"""Shared pytest fixtures.

``seed`` / ``rng``: every test that asks for them gets a *fresh* random seed (so repeated runs explore new data),
printed in the test's captured output, which pytest shows when the test fails.  Reproduce a failure with
``CUTE_MXFP8_TEST_SEED=<seed> python3 -m pytest ...``.
"""

from __future__ import annotations

import os
import pathlib
import random
import sys

import pytest
import torch

# Make the package importable when it is not installed (e.g. ``pytest tests/`` from a plain checkout).
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture
def seed(request) -> int:
    env = os.environ.get("CUTE_MXFP8_TEST_SEED")
    s = int(env) if env else random.SystemRandom().randrange(2**31)
    print(f"[{request.node.nodeid}] random seed {s}; rerun with CUTE_MXFP8_TEST_SEED={s}")
    return s


@pytest.fixture
def rng(seed) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from :func:`seed`."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g
