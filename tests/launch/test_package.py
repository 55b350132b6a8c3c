import importlib.metadata
import re
import subprocess
import sys

import qwentitan.launch


def test_version_comes_from_the_distribution_metadata():
    assert qwentitan.launch.__version__ == importlib.metadata.version("qwentitan-launch")
    assert re.fullmatch(r"\d+\.\d+\.\d+", qwentitan.launch.__version__)


def test_cli_help_imports_no_heavy_library():
    """`qwentitan-launch --help` (and each command's) builds its parser without torch & co."""
    probe = """
import sys
from qwentitan.launch.launcher.cli import build_parser
parser = build_parser()
parser.format_help()
(commands,) = [a for a in parser._actions if a.dest == "command"]
for command in commands.choices.values():
    command.format_help()
print(sorted(commands.choices))
print(sorted(m for m in ("torch", "torchtitan", "mlflow", "transformers") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    names, heavy = result.stdout.splitlines()
    assert "'train'" in names and "'plan'" in names
    assert heavy == "[]"
