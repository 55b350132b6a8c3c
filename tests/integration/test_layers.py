"""The written layers of docs/architecture.md, checked on the source text (ast, nothing imported).

Every import statement counts, wherever it stands: at the top, inside a function (lazy imports
are dependencies too) or under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "modeling", "checkpoint", "launch")
LAUNCH = "qwentitan.launch"

# The layers of qwentitan.launch are its subpackages: a module's layer is the folder it sits in
# directly below qwentitan.launch. The package root holds lazy names only and counts as base.
LAUNCH_LAYER_FOLDERS = ("base", "tracking", "runtime", "recipes", "launcher")

# Which layers (of qwentitan.launch) and which other distributions each layer may import.
# `qwentitan.checkpoint` (a declared dependency of launch) holds the workspace's one atomic-write
# helper and free-disk rule (`qwentitan.checkpoint.files`), which every layer that writes uses.
MAY_IMPORT: dict[str, set[str]] = {
    "base": {"base"},
    "tracking": {"base", "tracking", "qwentitan.checkpoint"},
    # checkpoint: the trainer checks a resumed `.metadata` with its SafeFileSystemReader
    "runtime": {
        "base",
        "tracking",
        "runtime",
        "qwentitan.modeling",
        "qwentitan.kernels",
        "qwentitan.checkpoint",
    },
    "recipes": {
        "base",
        "tracking",
        "runtime",
        "recipes",
        "qwentitan.modeling",
        "qwentitan.kernels",
        "qwentitan.checkpoint",
    },
    "launcher": {
        "base",
        "tracking",
        "runtime",
        "recipes",
        "launcher",
        "qwentitan.modeling",
        "qwentitan.kernels",
        "qwentitan.checkpoint",
    },
}


def source_modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for one distribution's src tree."""
    src = ROOT / "packages" / package / "src"
    modules = {}
    for file in sorted(src.rglob("*.py")):
        parts = file.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def imported_names(file: Path) -> Iterator[tuple[str, int]]:
    """Every `qwentitan...` name a file imports (`from a import b` gives `a.b`), with its line."""
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("qwentitan."):
                yield name, node.lineno


def resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name lives in: itself if a module, else the longest prefix."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def launch_layer(module: str) -> str:
    relative = module.removeprefix(LAUNCH).removeprefix(".")
    if not relative:
        return "base"
    folder = relative.split(".")[0]
    if folder not in LAUNCH_LAYER_FOLDERS:
        raise AssertionError(
            f"{module} sits in no layer folder; move it into one of {LAUNCH_LAYER_FOLDERS} "
            "(see docs/architecture.md)"
        )
    return folder


def launch_graph() -> dict[str, set[str]]:
    modules = source_modules("launch")
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, file in modules.items():
        for name, _ in imported_names(file):
            if name.startswith(LAUNCH + ".") or name == LAUNCH:
                graph[module].add(resolve(name, modules))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def distribution_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_every_launch_module_has_a_layer_and_imports_only_the_layers_below():
    modules = source_modules("launch")
    broken = []
    for module, file in modules.items():
        layer = launch_layer(module)
        for name, line in imported_names(file):
            if name.startswith(LAUNCH + ".") or name == LAUNCH:
                target = launch_layer(resolve(name, modules))
            else:
                target = distribution_of(name)
            if target not in MAY_IMPORT[layer]:
                where = file.relative_to(ROOT)
                broken.append(f"{where}:{line} ({layer}) imports {name} ({target})")
    assert not broken, "layer rules broken:\n" + "\n".join(broken)


def test_no_import_cycle_between_modules_of_each_package():
    for package in PACKAGES:
        modules = source_modules(package)
        graph = {
            module: {
                resolve(name, modules)
                for name, _ in imported_names(file)
                if distribution_of(name) == f"qwentitan.{package}"
            }
            for module, file in modules.items()
        }
        # a package's own __init__ re-exporting its modules is no cycle of design
        root = f"qwentitan.{package}"
        graph = {m: deps - {root} for m, deps in graph.items()}
        assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def declared_distributions(package: str) -> set[str]:
    """The qwentitan distributions a package's pyproject.toml declares (extras included)."""
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    declared = set()
    for requirement in requirements:
        name = requirement.split(";")[0].split("[")[0].strip()
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.startswith("qwentitan-"):
            declared.add("qwentitan." + name.removeprefix("qwentitan-"))
    return declared


# The package arrows: what each distribution may ever import, declared or not.
PACKAGE_MAY_IMPORT = {
    "kernels": set(),
    "checkpoint": set(),
    "modeling": {"qwentitan.kernels", "qwentitan.checkpoint"},
    "launch": {"qwentitan.kernels", "qwentitan.modeling", "qwentitan.checkpoint"},
}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_it_declares_and_the_arrows_allow(package):
    own = f"qwentitan.{package}"
    declared = declared_distributions(package)
    assert declared <= PACKAGE_MAY_IMPORT[package], f"{package} declares {declared}"
    broken = [
        f"{file.relative_to(ROOT)}:{line} imports {name}"
        for file in source_modules(package).values()
        for name, line in imported_names(file)
        if distribution_of(name) != own and distribution_of(name) not in declared
    ]
    assert not broken, f"{package} imports what it does not declare:\n" + "\n".join(broken)


def test_the_rules_catch_what_they_forbid():
    # the checks above would pass vacuously if the scanner saw no imports: prove it sees them
    graph = launch_graph()
    assert "qwentitan.launch.launcher.environment" in graph["qwentitan.launch.launcher.plan"]
    # an import inside a function counts (the rules ask resume for the saved steps when needed)
    assert "qwentitan.launch.launcher.resume" in graph["qwentitan.launch.launcher.plan_rules"]
    assert "qwentitan.launch.runtime.platforms" in graph["qwentitan.launch.runtime.trainer"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert launch_layer("qwentitan.launch.tracking.logger") == "tracking"
    assert launch_layer("qwentitan.launch.launcher.pilot") == "launcher"
    assert "launcher" not in MAY_IMPORT["runtime"] and "runtime" not in MAY_IMPORT["tracking"]
    assert "qwentitan.launch" not in PACKAGE_MAY_IMPORT["checkpoint"]


def test_the_code_cites_nothing_outside_this_repository():
    pattern = "shared" + "/"  # spelled apart so this file does not match itself
    cited = [
        f"{file.relative_to(ROOT)}:{number}"
        for top in ("packages", "tests", "benchmarks", "docs")
        for file in sorted((ROOT / top).rglob("*"))
        if file.suffix in {".py", ".md", ".toml"} and ".venv" not in file.parts
        for number, text in enumerate(file.read_text().splitlines(), 1)
        if pattern + "DESIGN" in text or pattern + "reference" in text
    ]
    assert not cited, f"references to documents outside this repository: {cited}"
