"""Shared fixtures of the kernel tests: the fake Neuron SDK of `fakes/`."""

from __future__ import annotations

import pytest

from qwentitan.kernels import nki_loader

from . import fakes


@pytest.fixture
def neuron(monkeypatch):
    """The fake Neuron SDK at nki-library 2.29, LNC=2, an empty kernel cache.

    Returns {kernel name: fake jit kernel}; each records the arguments of its launches.
    """
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    return fakes.install(monkeypatch, "2.29")
