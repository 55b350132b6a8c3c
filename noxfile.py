"""Every user-facing workflow of qwentitan. Run with `uv run nox -s <session>`."""

from __future__ import annotations

import hashlib
import os
import runpy
import sys
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "isolation"]

PACKAGES = ("kernels", "modeling", "checkpoint", "launch")
# The Neuron SDK versions, the DLAMI's venv and the indexes: one file, read here by path.
NEURON_SDK = runpy.run_path(
    str(Path(__file__).parent / "packages/launch/src/qwentitan/launch/base/neuron_sdk.py")
)


def _sync(session: nox.Session, *args: str, compiled: bool = True) -> None:
    """Install exactly what uv.lock says into this session's own environment; unless nothing in
    it runs Python code of ours (ruff is a binary), its bytecode is written as it is used."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location, "UV_COMPILE_BYTECODE": "0"},
        external=True,
    )
    if compiled:
        _bytecode_as_used(session)


def _bytecode_as_used(session: nox.Session) -> None:
    """A session's own environment is compiled as its processes import, not when it installs:
    each module's bytecode is written at its first import (PYTHONDONTWRITEBYTECODE=1, set on CI,
    would forbid it), into the environment's own folder (PYTHONPYCACHEPREFIX: nothing lands in
    the checkout). A test session imports about a fifth of what its environment holds (torch,
    torchtitan, transformers: ~4,500 of ~22,000 modules); compiling all of it at install took
    23 s (the launch package's environment) to 42 s (tests-3.13) on a 2-core machine."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(session.virtualenv.location) / "pycache")


# Bytecode of the workspace's environment is compiled when a session installs it, not in
# pyproject.toml: there uv would recompile the whole environment on every `uv run`
# (astral-sh/uv#12202). Where PYTHONDONTWRITEBYTECODE=1 (CI, many containers) nothing else would
# ever cache it. UV_COMPILE_BYTECODE=0 turns it off.
_COMPILE = {"UV_COMPILE_BYTECODE": os.environ.get("UV_COMPILE_BYTECODE", "1")}
# The workspace's one environment: what `uv run` syncs (the root project depends on the four
# packages), shared by every session that needs them, so `uv run qwentitan-launch` works after.
SHARED = {"venv_backend": "none"}


def _shared_env() -> Path:
    return Path(os.environ.get("UV_PROJECT_ENVIRONMENT", Path(__file__).parent / ".venv"))


def _uv_run(session: nox.Session, *command: str, **kwargs: object) -> str | bool | None:
    """`command` in the workspace's environment (`uv run --locked`), synced and byte-compiled
    once per uv.lock (a stamp in the environment remembers which)."""
    stamp = _shared_env() / ".qwentitan-compiled"
    digest = hashlib.sha256((Path(__file__).parent / "uv.lock").read_bytes()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == digest):
        compiling = _COMPILE["UV_COMPILE_BYTECODE"] not in ("0", "false")
        if compiling:  # the first run's longest silence otherwise (a minute on a small host)
            session.log("Compiling the environment's bytecode once for this uv.lock ...")
        started = time.monotonic()
        session.run("uv", "sync", "--locked", "--inexact", env=_COMPILE, external=True)
        if compiling:
            stamp.write_text(digest)
            session.log(
                f"Bytecode compiled in {time.monotonic() - started:.0f} s; later runs skip it."
            )
    return session.run("uv", "run", "--locked", *command, external=True, **kwargs)


def _interpreter(version: str) -> str:
    """A CPython `version` interpreter: pyenv's newest install of it, else the bare version for
    uv to find (pyenv's shims name only the active versions, so uv cannot see the others)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python{version}"))
    return str(found[-1]) if found else version


# The trn2 host's Python (the Neuron wheels exist for 3.12-3.14 only); CI rehearses on it too.
TRN2_PYTHON = "3.13"
# What can differ on that Python and the Neuron SDK's torch/transformers pair: the model code
# (both libraries), and in launch the stdlib's edges: argparse and the CLI's sentences, signals
# and subprocesses, paths and venvs, pickled tokenizer and corpus, sqlite through MLflow, tyro.
# The rest of tests/launch is plan arithmetic and text, the same on every Python.
TRN2_PYTHON_TESTS = (
    "tests/modeling",
    *(
        f"tests/launch/test_{name}.py"
        for name in (
            "package", "bad_input", "request", "train_cli", "preemption", "agent",
            "trn2_host", "data", "tracking", "config_settings",
        )
    ),
)  # fmt: skip


def _pytest(session: nox.Session, *paths: str, parallel: tuple[str, ...] | None = None) -> None:
    session.env.update(ONE_THREAD)
    workers = PARALLEL if parallel is None else parallel
    session.run("python", "-m", "pytest", *paths, *workers, *session.posargs)


# Two pytest-xdist workers: while one test waits (a process starting, a SLURM job, an install)
# the other uses the core. A file stays on one worker (tests/conftest.py's scheduler), and a
# training takes a core per rank across them (the `training_slot` fixture).
PARALLEL = ("-n", "2", "--dist", "loadfile")
# The kernels, modeling and checkpoint tests wait on almost nothing, so there a second worker
# only imports torch and the package's stack once more: in one process (`-n 0`), on an
# idle 2-core VM, the whole session: kernels 33 -> 17 core-seconds (wall 33 -> 18 s), modeling
# 79 -> 53 (52 s either way), checkpoint 28 -> 22 (29 -> 31 s). In CI, tests-3.13 runs beside.
ONE_PROCESS = ("-n", "0")
# Every process of a test session computes on one thread: the workers, the pilots and the other
# CI session beside them already fill the cores, and OpenMP threads beyond them spin waiting for
# each other. Two one-rank tiny trainings side by side on 2 cores took 28.5 CPU-s each with two
# threads (a rank's default here: the cores over its node's ranks) and 21.2 with one.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _pytest_shared(session: nox.Session, *paths: str) -> None:
    session.env.update(ONE_THREAD)
    _uv_run(session, "python", "-m", "pytest", *paths, *PARALLEL, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _sync(session, "--only-group", "dev", compiled=False)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(**SHARED)
def tests(session: nox.Session) -> None:
    """The whole test suite in the workspace's environment, which holds every package."""
    _pytest_shared(session, "tests")


@nox.session(name=f"tests-{TRN2_PYTHON}", python=_interpreter(TRN2_PYTHON))
def tests_trn2_python(session: nox.Session) -> None:
    """The CPU rehearsal on the trn2 host's Python with the Neuron SDK's torch and the AWS guide's
    Transformers (the `neuron-pair` group: torch 2.14.0, transformers 5.16.0; the other sessions
    run the lock's newest): what can differ by Python or by that pair (TRN2_PYTHON_TESTS; those
    marked slow are left to the 3.11 run) and a 4-step tiny training on one rank (2 x 64 tokens a
    step: what it shows is that the CLI trains on this Python; two gloo ranks on it are
    test_preemption's torchrun job)."""
    _sync(session, "--all-packages", "--group", "test", "--group", "neuron-pair")
    session.env.update(ONE_THREAD)
    session.run(
        "python", "-m", "pytest", *TRN2_PYTHON_TESTS, "-m", "not slow",
        "-p", "no:cacheprovider", *PARALLEL, *session.posargs,
    )  # fmt: skip
    run_dir = Path(session.create_tmp()) / "tiny-train"
    session.run(
        "qwentitan-launch", "train", "--ranks", "1", "--steps", "4", "--seq-len", "64",
        "--local-batch-size", "2", "--run-dir", str(run_dir),
        env={"QWENTITAN_MLFLOW": "off"},
    )  # fmt: skip


@nox.session
@nox.parametrize("package", PACKAGES)
def isolation(session: nox.Session, package: str) -> None:
    """One package, built as a wheel, alone with its declared dependencies: import it, run its tests."""
    # --reinstall-package: uv would otherwise reuse a cached wheel whose version has not changed
    # (it rebuilds a workspace member only when its pyproject.toml changes), of this package or
    # of a sibling it depends on.
    name = f"qwentitan-{package}"
    fresh = [arg for other in PACKAGES for arg in ("--reinstall-package", f"qwentitan-{other}")]
    _sync(session, "--package", name, "--no-editable", *fresh, "--group", "test")
    session.run("python", "-c", _IMPORT_CHECK.format(package=package))
    if package == "launch":
        _pytest(session, f"tests/{package}", *CROSS_PACKAGE_TESTS)
    else:
        _pytest(session, f"tests/{package}", parallel=ONE_PROCESS)


# The launch package declares the other three, so its environment is the whole stack built as
# wheels: the cross-package tests run there too, in the launch tests' pytest run (one install
# and byte-compile fewer, one pytest start, and the two workers kept busy to the end). The
# `integration` session runs them alone in the workspace's environment.
CROSS_PACKAGE_TESTS = ("tests/integration",)


@nox.session(**SHARED)
def integration(session: nox.Session) -> None:
    """Tests that cross packages (tests/integration), in the workspace's environment."""
    _pytest_shared(session, *CROSS_PACKAGE_TESTS)


# `qwentitan` must stay a namespace (no __init__.py) so the four wheels can share it, and a
# package must not reach a sibling it does not declare.
_IMPORT_CHECK = """
import importlib, importlib.metadata as md, qwentitan
assert getattr(qwentitan, "__file__", None) is None, "qwentitan/__init__.py must not exist"
importlib.import_module("qwentitan.{package}")
declared = {{r.split(";")[0].split("[")[0].strip() for r in md.requires("qwentitan-{package}") or []
            if "extra ==" not in r}}
for sibling in {packages!r}:
    if sibling != "{package}" and f"qwentitan-{{sibling}}" not in declared:
        try:
            importlib.import_module(f"qwentitan.{{sibling}}")
        except ModuleNotFoundError:
            continue
        raise SystemExit(f"qwentitan.{{sibling}} is importable but qwentitan-{package} does not declare it")
print("qwentitan.{package} imports alone")
""".replace("{packages!r}", repr(PACKAGES))


@nox.session(**SHARED)
def bench(session: nox.Session) -> None:
    """Benchmarks, as ratios against a baseline measured in the same run. `-- kernels` picks one;
    what follows the names goes to the scripts (`-- checkpoint --shapes qwen3-0.6b`)."""
    scripts = sorted(Path("benchmarks").glob("bench_*.py"))
    names = {script.stem.removeprefix("bench_") for script in scripts}
    picked = [arg for arg in session.posargs if arg in names]
    options = [arg for arg in session.posargs if arg not in names]
    for script in scripts:
        if not picked or script.stem.removeprefix("bench_") in picked:
            _uv_run(session, "python", str(script), *options)


@nox.session(**SHARED)
def train(session: nox.Session) -> None:
    """The main job: a tiny Qwen3 trained here with torchtitan, no download (`qwentitan-launch train`).

    Arguments after `--` go to the command: `--recipe tiny_moe`, `--steps 80 --resume`, `--ranks 1`.
    """
    _uv_run(session, "qwentitan-launch", "train", *session.posargs)


@nox.session(**SHARED)
def pilot(session: nox.Session) -> None:
    """hf vs native and native-moe vs moe-kernels, each pair from one seeded checkpoint, as child
    runs of one MLflow parent; fails when a pair's training or validation loss curves differ
    beyond their limit.

    Logs to ./mlflow.db (or $MLFLOW_TRACKING_URI); `-- --steps 20 --ranks 2` sets the size,
    `-- --help` lists the rest. Then `uv run nox -s mlflow_ui` and open the URLs it printed.
    """
    _uv_run(session, "qwentitan-launch", "pilot", *session.posargs)


@nox.session(**SHARED)
def mlflow_ui(session: nox.Session) -> None:
    """Serve the MLflow UI on the local store (./mlflow.db) at http://127.0.0.1:5000."""
    # The store training logs to, as qwentitan.launch's one reader of the environment says.
    where = "from qwentitan.launch.base.env_defaults import tracking_uri; print(tracking_uri())"
    store = _uv_run(session, "python", "-c", where, silent=True).strip()
    _uv_run(
        session,
        "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", "5000",
        *session.posargs,
    )  # fmt: skip


@nox.session(**SHARED)
def train_trn2(session: nox.Session) -> None:
    """A trn2.48xlarge recipe: `-- --recipe qwen3_4b_hf|qwen3_4b_native|qwen3_moe_kernels [--dry-run]`.

    On a trn2 host (`--neuron-venv V`, default the Neuron DLAMI's venv when it exists) it first
    installs qwentitan into an environment of its own, `--env E` (default .venv-trn2 here), that
    sees V's packages and holds only what V lacks, writing nothing into V
    (scripts/neuron_venv.py; `--stand-in` accepts a rehearsal venv without the Neuron SDK's
    torch or torch-neuronx; a package outside the Neuron stack that qwentitan needs at another
    version than V's is held in E in front of V's without a flag, said in one line, and
    `--shadow NAME` asks for it by name), then runs `qwentitan-launch run` with E's Python; `--dry-run`
    installs too and prints the plan, `--install-only` stops after the install. Without a
    Neuron venv it prints the plan from this workspace's environment and fails with one sentence
    (the CLI exits 2) unless `--dry-run`.
    Untested on Trainium: nothing in this repository has run there.
    """
    args = list(session.posargs)
    venv, args = _take_value(args, "--neuron-venv")
    env, args = _take_value(args, "--env")
    stand_in = "--stand-in" in args
    args = [a for a in args if a != "--stand-in"]
    shadow: list[str] = []
    while (name := _take_value(args, "--shadow"))[0] is not None:
        shadow.append(name[0])
        args = name[1]
    if venv is None and Path(NEURON_SDK["DLAMI_VENV"]).is_dir():
        venv = NEURON_SDK["DLAMI_VENV"]
    if not any(a == "--instance" or a.startswith("--instance=") for a in args):
        args += ["--instance", "trn2.48xlarge"]
    if venv is None and ("--install-only" in args or env or stand_in or shadow):
        session.error("--install-only, --env, --stand-in and --shadow need --neuron-venv V.")
    if venv is None:
        _uv_run(session, "qwentitan-launch", "run", *args)
        return
    env = str(Path(env or TRN2_ENV).absolute())
    session.run(
        sys.executable, "scripts/neuron_venv.py", "--venv", venv, "--env", env,
        *(["--stand-in"] * stand_in), *[a for n in shadow for a in ("--shadow", n)],
        env=_COMPILE, external=True,
    )  # fmt: skip
    if "--install-only" in args:
        return
    python = str(Path(env) / "bin" / "python")
    session.run(python, "-m", "qwentitan.launch.launcher.cli", "run", *args, external=True)


# qwentitan's own environment on the trn2 host, beside the Neuron venv (README, "On the trn2 host").
TRN2_ENV = Path(__file__).parent / ".venv-trn2"


def _take_value(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """`flag VALUE` (or `flag=VALUE`) taken out of the arguments: (VALUE or None, the rest)."""
    for i, arg in enumerate(args):
        if arg == flag:
            if i + 1 == len(args) or args[i + 1].startswith("-"):
                raise SystemExit(f"train_trn2: {flag} needs a value.")
            return args[i + 1], args[:i] + args[i + 2 :]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
    return None, args
