"""Install qwentitan into a Neuron venv without touching its Neuron SDK stack.

`uv run nox -s train_trn2 -- --neuron-venv DIR ...` runs this first (then `qwentitan-launch run`
with DIR's Python). DIR is the venv AWS documents: the Neuron DLAMI's
/opt/aws_neuronx_venv_torch_neuronx_2_14_0 or one made by hand (README, "On the trn2 host").

What it does, and why each step:
1. Asks DIR's Python for its version and the Neuron stack it holds; refuses a Python the
   Neuron wheels do not exist for (below 3.12), and a venv without torch (qwentitan never
   installs torch there: the Neuron SDK pins its own build).
2. Builds the workspace's four wheels (`uv build`).
3. Exports uv.lock's pinned requirements of qwentitan-launch (which needs the other three) with
   torch pruned from the tree, so neither torch nor what only torch needs (its CUDA libraries)
   is listed; refuses to go on if any protected or CUDA name is still there.
4. Installs the wheels and that list with `--no-deps`: exactly those versions and nothing
   resolved on top, so torch, torch-neuronx, neuronx-cc, nki and nki-library stay as they are.
5. Checks that they did (versions and their RECORD files, before and after).

Standard library only: it runs with the noxfile's Python, before qwentitan is installed anywhere.
Versions come from packages/launch/src/qwentitan/launch/base/neuron_sdk.py. Exit 2 with one
sentence for what a user can fix, as the CLIs do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDK = runpy.run_path(str(ROOT / "packages/launch/src/qwentitan/launch/base/neuron_sdk.py"))

# Runs inside the Neuron venv: its Python and, per stack package, version and RECORD digest.
_PROBE = """
import hashlib, importlib.metadata as md, json, sys
names = {names!r}
found = {{}}
for name in names:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    record = dist.read_text("RECORD") or ""
    found[name] = {{"version": dist.version,
                    "record": hashlib.sha256(record.encode()).hexdigest()}}
every = {{d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}}
print(json.dumps({{"python": list(sys.version_info[:3]), "packages": found, "all": every}}))
"""


class InstallError(Exception):
    """One sentence naming the fix."""


def probe(python: Path) -> dict:
    code = _PROBE.format(names=list(SDK["PROTECTED"]))
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise InstallError(
            f"{python} does not run ({done.stderr.strip().splitlines()[-1:]}); pass "
            "--neuron-venv pointing at a working Neuron venv."
        )
    return json.loads(done.stdout)


def describe(found: dict) -> str:
    python = ".".join(map(str, found["python"]))
    stack = ", ".join(
        f"{name} {found['packages'][name]['version']}" if name in found["packages"] else
        f"{name} not installed"
        for name in SDK["STACK"]
    )  # fmt: skip
    return f"Python {python}, {stack}"


def check_venv(venv: Path) -> tuple[Path, dict]:
    python = venv / "bin" / "python"
    if not python.exists():
        raise InstallError(
            f"No Python at {python}; pass --neuron-venv DIR naming the Neuron venv (the DLAMI's "
            f"is {SDK['DLAMI_VENV']})."
        )
    found = probe(python)
    if not SDK["python_supported"](tuple(found["python"])):
        have = ".".join(map(str, found["python"]))
        raise InstallError(
            f"The venv {venv} runs Python {have}, but the Neuron SDK {SDK['SDK_VERSION']} wheels "
            f"exist for Python {SDK['PYTHON_RANGE']} only; make the venv with Python 3.12, 3.13 "
            "or 3.14 (README, 'On the trn2 host')."
        )
    if "torch" not in found["packages"]:
        raise InstallError(
            f"The venv {venv} has no torch; install the Neuron SDK {SDK['SDK_VERSION']} packages "
            f"into it first (pip install {' '.join(SDK['REQUIREMENTS'])} --extra-index-url "
            f"{SDK['NEURON_INDEX']} --extra-index-url {SDK['TORCH_CPU_INDEX']})."
        )
    return python, found


def _uv(*args: str, capture: bool = False) -> str:
    done = subprocess.run(["uv", *args], cwd=ROOT, text=True, capture_output=capture, check=False)
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] if capture else []
        raise InstallError(f"`uv {args[0]}` failed {detail or ''}; see its output above.")
    return done.stdout or ""


_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def pinned_requirements() -> list[str]:
    """uv.lock's pins for qwentitan-launch and everything it needs, torch's subtree pruned."""
    text = _uv(
        "export", "--locked", "--package", "qwentitan-launch", "--no-dev", "--no-hashes",
        "--no-emit-workspace", "--no-header", "--no-annotate", "--format", "requirements.txt",
        "--prune", "torch", "--quiet", capture=True,
    )  # fmt: skip
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", "-"))]
    bad = [line for line in lines if SDK["is_protected"](_NAME.match(line).group(1))]
    if bad:  # uv.lock changed so that something besides torch needs one of them
        raise InstallError(
            f"uv.lock now requires {bad[0].split(';')[0].strip()} apart from torch, which would "
            "change the Neuron venv; drop that dependency or install by hand."
        )
    return lines


def build_wheels(out: Path) -> list[Path]:
    _uv("build", "--all-packages", "--wheel", "--out-dir", str(out), "--quiet")
    wheels = sorted(out.glob("qwentitan_*.whl"))
    if len(wheels) != 4:
        raise InstallError(f"uv build made {len(wheels)} qwentitan wheels, not 4; see above.")
    return wheels


def install(venv: Path) -> dict:
    """Install into `venv`; returns what was found and done (printed by `main`)."""
    start = time.perf_counter()
    python, before = check_venv(venv)
    print(f"neuron venv {venv}: {describe(before)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="qwentitan-wheels-") as tmp:
        wheels = build_wheels(Path(tmp))
        requirements = Path(tmp) / "requirements.txt"
        pins = pinned_requirements()
        requirements.write_text("\n".join(pins) + "\n")
        names = [w.name.split("-")[0].replace("_", "-") for w in wheels]
        reinstall = [arg for name in names for arg in ("--reinstall-package", name)]
        _uv(
            "pip", "install", "--python", str(python), "--no-deps", *reinstall,
            "-r", str(requirements), *map(str, wheels),
        )  # fmt: skip
    after = probe(python)
    changed = [
        name
        for name in set(before["packages"]) | set(after["packages"])
        if before["packages"].get(name) != after["packages"].get(name)
    ]
    if changed:
        raise InstallError(
            f"The install changed {', '.join(sorted(changed))} in {venv}; reinstall the Neuron "
            "SDK packages there and report this."
        )
    # What the venv's own packages declare (torch-neuronx's requirements among them) against
    # the pins just installed: reported, since only a trn2 host holds the real Neuron wheels.
    check = subprocess.run(
        ["uv", "pip", "check", "--python", str(python)], capture_output=True, text=True, cwd=ROOT
    )
    if check.returncode != 0:
        conflicts = [line.strip() for line in check.stdout.splitlines() if line.strip()]
        print("neuron venv: warning, uv pip check: " + "; ".join(conflicts[-8:]), flush=True)
    was, now = before["all"], after["all"]
    return {
        "venv": str(venv),
        "found": describe(after),
        "qwentitan_wheels": len(wheels),
        "pinned": len(pins),
        "added": sorted(set(now) - set(was)),
        "replaced": sorted(
            f"{n} {was[n]} -> {now[n]}" for n in set(was) & set(now) if was[n] != now[n]
        ),
        "seconds": round(time.perf_counter() - start, 1),
    }


def default_venv() -> Path | None:
    dlami = Path(SDK["DLAMI_VENV"])
    return dlami if dlami.is_dir() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help=f"the Neuron venv (default {SDK['DLAMI_VENV']})")
    args = parser.parse_args(argv)
    venv = args.venv or default_venv()
    try:
        if venv is None:
            raise InstallError(
                f"No Neuron venv: {SDK['DLAMI_VENV']} does not exist here; pass --neuron-venv DIR."
            )
        done = install(venv.expanduser().absolute())
    except InstallError as error:
        print(f"neuron venv: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("neuron venv: interrupted (Ctrl-C); run it again.", file=sys.stderr)
        return 2
    replaced = ", ".join(done["replaced"]) or "none"
    print(
        f"neuron venv: installed the {done['qwentitan_wheels']} qwentitan wheels and "
        f"{done['pinned']} pinned dependencies (--no-deps, torch's tree pruned) in "
        f"{done['seconds']} s: {len(done['added'])} distributions added, versions changed: "
        f"{replaced}; untouched: {done['found']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UV_NO_PROGRESS", "1")
    sys.exit(main())
