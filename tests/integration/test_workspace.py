"""The four distributions share one `qwentitan` namespace and are versioned independently."""

import importlib
import importlib.metadata
import json
import pathlib

import qwentitan

PACKAGES = ("kernels", "modeling", "checkpoint", "launch")


def test_qwentitan_is_a_namespace_shared_by_four_distributions():
    assert getattr(qwentitan, "__file__", None) is None
    roots = {
        pathlib.Path(importlib.import_module(f"qwentitan.{p}").__file__).parent.parent
        for p in PACKAGES
    }
    # Editable installs put each package's src/qwentitan on the path: four roots, one namespace;
    # installed wheels share one site-packages/qwentitan.
    editable = {_editable(f"qwentitan-{p}") for p in PACKAGES}
    assert len(editable) == 1, "the four packages are installed the same way"
    assert len(roots) == (4 if editable.pop() else 1), roots


def _editable(distribution: str) -> bool:
    direct_url = importlib.metadata.distribution(distribution).read_text("direct_url.json")
    return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))


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
