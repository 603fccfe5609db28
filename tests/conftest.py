"""Test-wide settings: Triton's interpreter, a fresh printed seed per test, hypothesis profiles.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU
tensors; the variable must be set before any ``triton.jit`` decoration runs.

Every test starts from a fresh random seed (torch, numpy and ``random`` are
seeded with it) and prints it, so a failing test's captured output says how
to rerun it: ``SPARSEKV_TEST_SEED=<seed> pytest <test id>``. A test that
builds its own generator takes the ``seed`` fixture.

Hypothesis runs the ``ci`` profile (derandomised: the same examples on every
run) when the ``CI`` environment variable is set, else the ``dev`` profile
(random examples); ``SPARSEKV_HYPOTHESIS_PROFILE`` picks one explicitly. The
pytest header names the profile loaded.
"""

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

SEED_ENV = "SPARSEKV_TEST_SEED"
PROFILE_ENV = "SPARSEKV_HYPOTHESIS_PROFILE"

settings.register_profile("dev", deadline=None, max_examples=30, derandomize=False)
settings.register_profile("ci", deadline=None, max_examples=30, derandomize=True, print_blob=True)
HYPOTHESIS_PROFILE = os.environ.get(PROFILE_ENV) or ("ci" if os.environ.get("CI") else "dev")
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header(config):
    chosen = f"{PROFILE_ENV}" if os.environ.get(PROFILE_ENV) else ("CI is set" if os.environ.get("CI") else
                                                                    "CI is not set")
    seeds = f"fixed by {SEED_ENV}={os.environ[SEED_ENV]}" if os.environ.get(SEED_ENV) else "fresh per test, printed"
    return [f"hypothesis profile: {HYPOTHESIS_PROFILE} ({chosen}; derandomize={settings().derandomize})",
            f"random seeds: {seeds}"]


@pytest.fixture(autouse=True)
def seed() -> int:
    """A fresh seed for this test (``SPARSEKV_TEST_SEED`` fixes it), already given to torch, numpy and random."""
    value = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**31))
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
    print(f"random seed {value} (rerun with {SEED_ENV}={value})")
    return value
