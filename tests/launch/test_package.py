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


def test_the_first_nox_run_says_it_compiles_the_bytecode_once(tmp_path, monkeypatch):
    """Issue 56: `_uv_run` says, before and after (with the time), that it byte-compiles the
    environment once per uv.lock; the next run, stamped, says nothing and syncs nothing."""
    import runpy
    from pathlib import Path

    import pytest

    pytest.importorskip("nox")
    monkeypatch.setenv("UV_PROJECT_ENVIRONMENT", str(tmp_path))
    monkeypatch.delenv("UV_COMPILE_BYTECODE", raising=False)
    noxfile = runpy.run_path(str(Path(__file__).parents[2] / "noxfile.py"))

    class Session:
        def __init__(self) -> None:
            self.said: list[str] = []
            self.ran: list[tuple[str, ...]] = []

        def log(self, line: str) -> None:
            self.said.append(line)

        def run(self, *command: str, **_: object) -> None:
            self.ran.append(command)

    first, second = Session(), Session()
    noxfile["_uv_run"](first, "qwentitan-launch", "train")
    noxfile["_uv_run"](second, "qwentitan-launch", "train")
    assert first.said[0] == "Compiling the environment's bytecode once for this uv.lock ..."
    assert re.fullmatch(r"Bytecode compiled in \d+ s; later runs skip it\.", first.said[1])
    assert [c[:2] for c in first.ran] == [("uv", "sync"), ("uv", "run")]
    assert second.said == [] and [c[:2] for c in second.ran] == [("uv", "run")]
