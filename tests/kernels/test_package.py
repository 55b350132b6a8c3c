import ast
import importlib.metadata
import re
from pathlib import Path

import qwentitan.kernels


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.kernels.__version__ == importlib.metadata.version("qwentitan-kernels")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.kernels.__version__)


def _reads_the_environment(tree: ast.AST) -> bool:
    """`os.environ`, `os.getenv` or either imported by name (`from os import environ`)."""
    names = {"environ", "environb", "getenv", "getenvb"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in names for alias in node.names)
        ):
            return True
    return False


def test_one_module_reads_the_environment():
    package = Path(qwentitan.kernels.__file__).parent
    readers = sorted(
        file.relative_to(package).as_posix()
        for file in package.rglob("*.py")
        if _reads_the_environment(ast.parse(file.read_text()))
    )
    assert readers == ["env.py"]
    # and its docstring lists every variable the package names
    documented = ast.get_docstring(ast.parse((package / "env.py").read_text()))
    assert "`QWENTITAN_KERNELS`" in documented and "`NEURON_LOGICAL_NC_CONFIG`" in documented
