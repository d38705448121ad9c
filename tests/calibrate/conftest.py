"""Shared data for the calibration tests (seeded, float32 like real activations)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def gaussian() -> np.ndarray:
    return np.random.default_rng(11).standard_normal(200_000).astype(np.float32)


@pytest.fixture(scope="session")
def laplacian() -> np.ndarray:
    return np.random.default_rng(12).laplace(size=200_000).astype(np.float32)


@pytest.fixture(scope="session")
def heavy_tailed() -> np.ndarray:
    """Student-t with 3 degrees of freedom: a few values far out, as in real activations."""
    return np.random.default_rng(13).standard_t(3, size=200_000).astype(np.float32)
