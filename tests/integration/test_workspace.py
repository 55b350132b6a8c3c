"""The four distributions share one `qwentitan` namespace and are versioned independently."""

import importlib
import importlib.metadata
import pathlib

import qwentitan

PACKAGES = ("kernels", "modeling", "checkpoint", "launch")


def test_qwentitan_is_a_namespace_shared_by_four_distributions():
    assert getattr(qwentitan, "__file__", None) is None
    roots = {
        pathlib.Path(importlib.import_module(f"qwentitan.{p}").__file__).parent.parent
        for p in PACKAGES
    }
    # Editable installs put each package's src/qwentitan on the path: four roots, one namespace.
    assert len(roots) in (1, 4)


def test_each_distribution_declares_only_the_siblings_the_design_allows():
    allowed = {
        "kernels": set(),
        "modeling": {"qwentitan-kernels", "qwentitan-checkpoint"},  # checkpoint reads HF folders
        "checkpoint": set(),
        "launch": {"qwentitan-kernels", "qwentitan-modeling", "qwentitan-checkpoint"},
    }
    for package, may_use in allowed.items():
        requires = importlib.metadata.requires(f"qwentitan-{package}") or []
        siblings = {
            r.split(";")[0].split("[")[0].strip() for r in requires if r.startswith("qwentitan-")
        }
        assert siblings <= may_use, f"qwentitan-{package} depends on {siblings - may_use}"
