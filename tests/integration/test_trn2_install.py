"""A rehearsal of the trn2 install: `nox -s train_trn2 -- --neuron-venv DIR` into a stand-in
Neuron venv (Python 3.12 with small wheels named torch 2.14.0, torch-neuronx 2.14.3.0, neuronx-cc
and nki), which must leave those four exactly as they were and make qwentitan importable there.

The stand-in torch is a few bytes, so the plan itself (which builds torchtitan configs) is not
printed here: the README's "On the trn2 host" shows that step with a real torch.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STACK = {
    "torch": ("2.14.0", "torch"),
    "torch-neuronx": ("2.14.3.0", "torch_neuronx"),
    "neuronx-cc": ("2.21.33.0", "neuronxcc"),
    "nki": ("0.3.0", "nki"),
}


def pyenv_python(version: str) -> Path | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python{version}"))
    return found[-1] if found else None


def make_wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel holding `module/__init__.py` with its `__version__`."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f'__version__ = "{version}"\nSTAND_IN = True\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def standin_venv(where: Path, python: Path) -> Path:
    """A venv of `python` holding the four stand-in Neuron stack wheels."""
    venv = where / "neuron-venv"
    subprocess.run(["uv", "venv", "--quiet", "--python", str(python), str(venv)], check=True)
    wheels = [make_wheel(where, name, v, m) for name, (v, m) in STACK.items()]
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            str(venv / "bin/python"),
            *map(str, wheels),
        ],
        check=True,
    )
    return venv


def stack_digest(venv: Path) -> dict[str, str]:
    """sha256 of every file of the four stack packages (modules and dist-info)."""
    site = next((venv / "lib").glob("python3.*/site-packages"))
    digests = {}
    for name, (version, module) in STACK.items():
        paths = [
            *(site / module).rglob("*"),
            *(site / f"{name.replace('-', '_')}-{version}.dist-info").rglob("*"),
        ]
        files = sorted(p for p in paths if p.is_file() and "__pycache__" not in p.parts)
        assert files, f"{name} is not in the stand-in venv"
        digests[name] = hashlib.sha256(
            b"".join(p.relative_to(site).as_posix().encode() + p.read_bytes() for p in files)
        ).hexdigest()
    return digests


def nox_train_trn2(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["uv", "run", "--locked", "nox", "-s", "train_trn2", "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "UV_COMPILE_BYTECODE": "0"},  # faster; the host install compiles
    )


needs_uv = pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH")


@pytest.mark.slow
@needs_uv
@pytest.mark.skipif(pyenv_python("3.12") is None, reason="needs pyenv's Python 3.12")
def test_install_into_a_neuron_venv_leaves_its_stack_alone(tmp_path: Path) -> None:
    venv = standin_venv(tmp_path, pyenv_python("3.12"))
    before = stack_digest(venv)

    done = nox_train_trn2("--neuron-venv", str(venv), "--recipe", "qwen3_4b_hf", "--install-only")

    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "torch-neuronx 2.14.3.0" in out  # it names the Neuron stack it found
    assert stack_digest(venv) == before
    python = str(venv / "bin/python")
    listed = subprocess.run(
        ["uv", "pip", "list", "--python", python, "--format", "freeze"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert not {n for n in names if n.startswith(("nvidia-", "triton", "cuda-"))}
    assert {"qwentitan-launch", "torchtitan", "transformers", "mlflow"} <= names
    imported = subprocess.run(
        [python, "-c", "import torch, torch_neuronx, neuronxcc, nki, qwentitan.launch; "
         "from qwentitan.launch.launcher.cli import build_parser; build_parser(); "
         "print(torch.__version__, torch.STAND_IN, qwentitan.launch.__version__)"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("2.14.0 True ")


@needs_uv
@pytest.mark.skipif(pyenv_python("3.11") is None, reason="needs pyenv's Python 3.11")
def test_a_python_311_venv_is_refused_naming_312(tmp_path: Path) -> None:
    venv = standin_venv(tmp_path, pyenv_python("3.11"))
    before = stack_digest(venv)

    done = nox_train_trn2("--neuron-venv", str(venv), "--recipe", "qwen3_4b_hf", "--dry-run")

    assert done.returncode != 0
    out = done.stdout + done.stderr  # nox passes a command's stderr on as its stdout
    message = [line for line in out.splitlines() if line.startswith("neuron venv:")]
    assert len(message) == 1 and "3.12-3.14" in message[0] and "Python 3.11" in message[0]
    assert stack_digest(venv) == before
