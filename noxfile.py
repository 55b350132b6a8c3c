"""Every user-facing workflow of qwentitan. Run with `uv run nox -s <session>`."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "isolation", "integration"]

PACKAGES = ("kernels", "modeling", "checkpoint", "launch")


def _sync(session: nox.Session, *args: str) -> None:
    """Install exactly what uv.lock says into this session's environment."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", *paths, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite in one environment holding every package."""
    _sync(session, "--all-packages", "--group", "test")
    _pytest(session, "tests")


@nox.session
@nox.parametrize("package", PACKAGES)
def isolation(session: nox.Session, package: str) -> None:
    """One package, built as a wheel, alone with its declared dependencies: import it, run its tests."""
    # --reinstall-package: uv would otherwise reuse a cached wheel whose version has not changed.
    name = f"qwentitan-{package}"
    _sync(
        session, "--package", name, "--no-editable", "--reinstall-package", name, "--group", "test"
    )
    session.run("python", "-c", _IMPORT_CHECK.format(package=package))
    _pytest(session, f"tests/{package}")


@nox.session
def integration(session: nox.Session) -> None:
    """Tests that cross packages (tests/integration), in the full workspace environment."""
    _sync(session, "--all-packages", "--group", "test")
    _pytest(session, "tests/integration")


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


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks, as ratios against a baseline measured in the same run. `-- kernels` picks one."""
    _sync(session, "--all-packages")
    for script in sorted(Path("benchmarks").glob("bench_*.py")):
        if not session.posargs or script.stem.removeprefix("bench_") in session.posargs:
            session.run("python", str(script))


@nox.session
def train(session: nox.Session) -> None:
    """The main job: a tiny Qwen3 trained here with torchtitan, no download (`qwentitan-launch train`).

    Arguments after `--` go to the command: `--recipe tiny_moe`, `--steps 80 --resume`, `--ranks 1`.
    """
    _sync(session, "--all-packages")
    session.run("qwentitan-launch", "train", *session.posargs)


@nox.session
def pilot(session: nox.Session) -> None:
    """hf vs native and native-moe vs moe-kernels, each pair from one seeded checkpoint, as child
    runs of one MLflow parent; fails when a pair's loss curves differ beyond their limit.

    Logs to ./mlflow.db (or $MLFLOW_TRACKING_URI); `-- --steps 20 --ranks 2` sets the size,
    `-- --help` lists the rest. Then `uv run nox -s mlflow_ui` and open the URLs it printed.
    """
    _sync(session, "--all-packages")
    session.run("qwentitan-launch", "pilot", *session.posargs)


@nox.session
def mlflow_ui(session: nox.Session) -> None:
    """Serve the MLflow UI on the local store (./mlflow.db) at http://127.0.0.1:5000."""
    _sync(session, "--all-packages")
    # The store training logs to, as qwentitan.launch's one reader of the environment says.
    where = "from qwentitan.launch.base.env_defaults import tracking_uri; print(tracking_uri())"
    store = session.run("python", "-c", where, silent=True).strip()
    session.run(
        "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", "5000",
        *session.posargs,
    )  # fmt: skip


@nox.session
def train_trn2(session: nox.Session) -> None:
    """A trn2.48xlarge recipe: `-- --recipe qwen3_4b_hf|qwen3_4b_native|qwen3_moe_kernels [--dry-run]`.

    Launches torchrun on a host with Neuron devices. On any other host it prints the plan and
    fails with one sentence (the CLI exits 2); `--dry-run` prints the plan anywhere. Untested on
    Trainium: nothing in this repository has run there.
    """
    _sync(session, "--all-packages")
    args = list(session.posargs)
    if not any(a == "--instance" or a.startswith("--instance=") for a in args):
        args += ["--instance", "trn2.48xlarge"]
    session.run("qwentitan-launch", "run", *args)
