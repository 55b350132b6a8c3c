"""Shared fixtures of the kernel tests: the fake Neuron SDK of `fakes/`."""

from __future__ import annotations

import pytest

from qwentitan.kernels import nki_loader

from . import fakes


@pytest.fixture(params=fakes.nkilib.GENERATIONS)
def neuron(request, monkeypatch):
    """The fake Neuron SDK at each nki-library generation, LNC=2, an empty kernel cache.

    Every test that takes it runs once per generation: nki-library 2.29 and commit 092a49d,
    whose MoE backward validates the sharding options that 2.29 ignored.
    Returns {kernel name: fake jit kernel}; each records the arguments of its launches.
    """
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    return fakes.install(monkeypatch, request.param)
