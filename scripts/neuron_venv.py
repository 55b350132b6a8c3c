"""Install qwentitan into an environment of its own beside a Neuron venv, writing nothing into it.

`uv run nox -s train_trn2 -- --neuron-venv V [--env E]` runs this first, then `qwentitan-launch
run` with E's Python. V is the venv AWS documents: the Neuron DLAMI's
/opt/aws_neuronx_venv_torch_neuronx_2_14_0, or one made by hand (README, "On the trn2 host").
E defaults to .venv-trn2 in the checkout.

What it does, and why each step:
1. Asks V's Python (`-I -B`: no user paths, no bytecode written) for its version, whether it is
   a venv and every distribution it holds; refuses, one sentence each, a V whose Python does not
   run or does not answer, that is no venv, runs a Python the Neuron wheels do not exist for,
   has no torch or not torch 2.14.0, or no torch-neuronx (`--stand-in` lets a rehearsal pass the
   last two).
2. Makes E a venv on V's base interpreter whose site-packages holds a .pth adding V's
   site-packages after E's own (`site.addsitedir`, so V's own .pth files work as in V): E's
   Python imports V's torch, torch-neuronx, neuronx-cc and nki, and a package E holds comes
   first.
3. Resolves qwentitan's four wheels (`neuron_resolve.py`) with every distribution V holds offered
   at V's version only, with V's own metadata, and pinned by a constraint; transformers is the
   AWS guide's 5.16.0 where V has none. The exceptions are torchtitan, unless V's is upstream
   0.3.0 (AWS's fork stays in V for AWS's tutorials, shadowed in E), and qwentitan's own wheels.
   A conflict on a package outside the Neuron stack is resolved again with E holding its own
   version in front of V's, within what V's packages require of it, and said in one line; a
   conflict that leaves no such version (or on the Neuron stack itself) is refused naming the
   package, who needs which version and the fix.
4. Installs exactly what V lacks into E (`uv pip sync`: nothing resolved on top, and what an
   earlier install left in E and is no longer needed is removed).
5. Checks that V's distributions are unchanged (versions and RECORD digests) and that E's
   Python finds V's stack and upstream torchtitan in E.

Standard library only: it runs with the noxfile's Python, before qwentitan is installed anywhere.
Versions come from packages/launch/src/qwentitan/launch/base/neuron_sdk.py. Exit 2 with one
sentence for what a user can fix, as the CLIs do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from neuron_resolve import ROOT, SDK, InstallError, Resolution, check_shadow, resolve, uv

PROBE_TAG = "qwentitan-neuron-venv-probe/1"
# The probe reads every distribution's metadata: seconds on the DLAMI's venv. A python that has
# not answered in this long never will (it hangs, or waits on something).
PROBE_TIMEOUT_S = 120
# The modules whose origin the check after the install reads in E.
STACK_MODULES = ("torch", "torch_neuronx", "neuronxcc", "nki", "torchtitan", "numpy")
PTH_NAME = "_qwentitan_neuron_venv.pth"

# Runs in a venv's Python: its version, prefixes and site folders, every distribution (the first
# of each name on sys.path, the one imported) and where the modules named in argv come from.
_PROBE = """
import hashlib, importlib.metadata as md, importlib.util, json, re, sys, sysconfig
dists = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    key = re.sub(r"[-_.]+", "-", (name or "").lower())
    if not name or key in dists:
        continue
    record = dist.read_text("RECORD") or ""
    dists[key] = {"name": name, "version": dist.version, "requires": dist.requires or [],
                  "requires_python": dist.metadata["Requires-Python"],
                  "extras": dist.metadata.get_all("Provides-Extra") or [],
                  "site": str(dist.locate_file("")),
                  "record": hashlib.sha256(record.encode()).hexdigest()}
modules = {}
for module in sys.argv[1:]:
    spec = importlib.util.find_spec(module)
    modules[module] = None if spec is None else (spec.origin if spec.origin not in (None, "namespace")
        else next(iter(spec.submodule_search_locations or []), None))
paths = sysconfig.get_paths()
print(json.dumps({"probe": TAG, "python": list(sys.version_info[:3]), "prefix": sys.prefix,
    "base_prefix": sys.base_prefix, "base_executable": getattr(sys, "_base_executable", ""),
    "site": sorted({paths["purelib"], paths["platlib"]}), "dists": dists, "modules": modules}))
""".replace("TAG", repr(PROBE_TAG))


def probe(python: Path, modules: tuple[str, ...] = ()) -> dict:
    """What `python` says of itself (`_PROBE`), or a refusal naming how it failed to answer."""
    fix = (
        f"pass --neuron-venv naming the Neuron venv (a folder with bin/python; the DLAMI's is "
        f"{SDK['DLAMI_VENV']})"
    )
    if not python.is_file() or not os.access(python, os.X_OK):
        raise InstallError(f"{python} is not an executable Python; {fix}.")
    try:
        done = _run_bounded([str(python), "-I", "-B", "-c", _PROBE, *modules], PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InstallError(
            f"{python} did not answer within {PROBE_TIMEOUT_S} s (it and what it started were "
            f"ended); {fix}."
        ) from None
    except OSError as error:
        raise InstallError(f"{python} does not run ({error.strerror or error}); {fix}.") from None
    # bytes: what a program that is no Python prints need not be UTF-8
    out, err = (data.decode("utf-8", "replace").strip() for data in (done.stdout, done.stderr))
    lines = out.splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if done.returncode != 0 or not _answered(answer):
        said = (err or out).splitlines()[-1:]
        heard = f", last said {said[0][:160]!r}" if said else ""
        raise InstallError(
            f"{python} did not answer as a Python venv does (exit {done.returncode}{heard}); {fix}."
        )
    return answer


def _run_bounded(argv: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    """`argv`'s output, in a process group of its own that is killed whole (its children too)
    when it runs past `timeout` or this process is interrupted."""
    child = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


# What the probe's answer holds, each field of the type the checks after it read.
_ANSWER = {"python": list, "prefix": str, "base_prefix": str, "base_executable": str,
           "site": list, "dists": dict, "modules": dict}  # fmt: skip
_DIST = {"name": str, "version": str, "site": str, "record": str, "requires": list, "extras": list,
         "requires_python": str | type(None)}  # fmt: skip


def _answered(answer: object) -> bool:
    """Whether `answer` is what `_PROBE` prints: a program that is not the probe's Python
    (a script named bin/python) may print any JSON, even one with the tag."""
    if not isinstance(answer, dict) or answer.get("probe") != PROBE_TAG:
        return False
    if not all(isinstance(answer.get(key), kind) for key, kind in _ANSWER.items()):
        return False
    version, site, dists = answer["python"], answer["site"], answer["dists"]
    return (
        len(version) == 3
        and all(type(part) is int for part in version)
        and all(isinstance(folder, str) for folder in site)
        and all(
            isinstance(dist, dict) and all(isinstance(dist.get(k), t) for k, t in _DIST.items())
            for dist in dists.values()
        )
    )


def version_of(found: dict, name: str) -> str | None:
    dist = found["dists"].get(SDK["normalize"](name))
    return None if dist is None else dist["version"]


def describe(found: dict) -> str:
    python = ".".join(map(str, found["python"]))
    stack = ", ".join(
        f"{name} {version_of(found, name) or 'not installed'}" for name in SDK["STACK"]
    )
    return f"Python {python}, {stack}"


def check_venv(venv: Path, stand_in: bool) -> tuple[Path, dict]:
    """V's Python and its probe, or a refusal naming what keeps it from being the Neuron venv."""
    python = venv / "bin" / "python"
    found = probe(python)
    if found["prefix"] == found["base_prefix"]:
        raise InstallError(
            f"{venv} is a Python installation, not a venv; pass --neuron-venv naming the "
            f"Neuron venv (the DLAMI's is {SDK['DLAMI_VENV']})."
        )
    if not SDK["python_supported"](tuple(found["python"])):
        have = ".".join(map(str, found["python"]))
        raise InstallError(
            f"The venv {venv} runs Python {have}, but the Neuron SDK {SDK['SDK_VERSION']} wheels "
            f"exist for Python {SDK['PYTHON_RANGE']} only; make the venv with Python 3.12, 3.13 "
            "or 3.14 (README, 'On the trn2 host')."
        )
    install = (
        f"pip install {' '.join(SDK['REQUIREMENTS'])} --extra-index-url {SDK['NEURON_INDEX']} "
        f"--extra-index-url {SDK['TORCH_CPU_INDEX']}"
    )
    torch = version_of(found, "torch")
    if torch is None:
        raise InstallError(
            f"The venv {venv} has no torch; install the Neuron SDK packages into it first "
            f"({install})."
        )
    rehearse = "or pass --stand-in to rehearse on this venv without Trainium"
    if not SDK["matches"](torch, SDK["TORCH"]) and not stand_in:
        raise InstallError(
            f"The venv {venv} holds torch {torch}, but torch-neuronx {SDK['TORCH_NEURONX']} "
            f"(Neuron SDK {' and '.join(SDK['SDK_VERSIONS'])}) is built for torch "
            f"{SDK['TORCH']} only; install the documented stack there ({install}), {rehearse}."
        )
    if version_of(found, "torch-neuronx") is None and not stand_in:
        raise InstallError(
            f"The venv {venv} has no torch-neuronx, so it cannot train on Trainium; install the "
            f"Neuron SDK packages there ({install}), {rehearse}."
        )
    return python, found


def _venv_config(folder: Path) -> dict[str, str]:
    """A venv's pyvenv.cfg as a dict (empty when there is none)."""
    try:
        text = (folder / "pyvenv.cfg").read_text()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def make_env(env: Path, venv: Path, found: dict) -> Path:
    """E: a venv on V's base interpreter that sees V's packages after its own. Returns its Python."""
    if env == venv or venv in env.parents or env in venv.parents:
        raise InstallError(
            f"--env {env} overlaps the Neuron venv {venv}; pass --env naming a folder of its own "
            "(default .venv-trn2 in the checkout)."
        )
    existing = _venv_config(env)
    made_here = any(env.glob(f"lib/python*/site-packages/{PTH_NAME}"))
    if env.exists() and any(env.iterdir()) and not (existing and made_here):
        # `uv pip sync` would remove what the folder holds: only an earlier E is reused.
        raise InstallError(
            f"--env {env} already holds files and is no environment this install made; pass "
            "--env naming a new folder or the environment an earlier install made."
        )
    version = ".".join(map(str, found["python"]))
    fresh = ["--clear"] if existing and existing.get("version_info") != version else []
    system = _venv_config(venv).get("include-system-site-packages", "").lower() == "true"
    uv(
        "venv", "--quiet", "--allow-existing", *fresh, *(["--system-site-packages"] * system),
        "--python", found["base_executable"] or str(venv / "bin" / "python"), str(env),
    )  # fmt: skip
    python = env / "bin" / "python"
    site = Path(probe(python)["site"][0])
    # A .pth's `import` line runs at startup: V's site folders are added after E's own, and
    # their own .pth files (editable installs among them) are read as V's Python reads them.
    lines = [f"import site; site.addsitedir({folder!r})" for folder in found["site"]]
    temporary = site / f".{PTH_NAME}.tmp"
    temporary.write_text(
        "# Written by qwentitan's scripts/neuron_venv.py: the Neuron venv's packages, after "
        "this environment's own.\n" + "\n".join(lines) + "\n"
    )
    os.replace(temporary, site / PTH_NAME)
    return python


def check_after(venv: Path, before: dict, after: dict, env_found: dict) -> None:
    """V unchanged, and E's Python importing V's stack with upstream torchtitan from E."""
    was, now = before["dists"], after["dists"]
    changed = sorted(
        was.get(key, now.get(key, {})).get("name", key)
        for key in set(was) | set(now)
        if {k: v for k, v in was.get(key, {}).items() if k != "site"}
        != {k: v for k, v in now.get(key, {}).items() if k != "site"}
    )
    if changed:
        raise InstallError(
            f"The Neuron venv {venv} changed during the install ({', '.join(changed[:5])}); "
            "something else wrote into it: reinstall the Neuron SDK packages there and report it."
        )
    modules = env_found["modules"]
    for module in ("torch", "torch_neuronx", "neuronxcc", "nki"):
        origin = modules.get(module)
        if origin is not None and not any(origin.startswith(s) for s in before["site"]):
            raise InstallError(
                f"The trn2 environment imports {module} from {origin}, not from the Neuron venv "
                f"{venv}; remove it from the environment (uv pip uninstall) and run again."
            )
    titan = version_of(env_found, "torchtitan")
    if titan != SDK["TORCHTITAN_UPSTREAM"]:
        raise InstallError(
            f"The trn2 environment imports torchtitan {titan}, not "
            f"{SDK['TORCHTITAN_UPSTREAM']}; run the install again and report it if it repeats."
        )


def install(venv: Path, env: Path, *, stand_in: bool = False, shadow: list[str] = ()) -> dict:
    """Install into E beside V; returns what was found and done (printed by `main`)."""
    start = time.perf_counter()
    python, before = check_venv(venv, stand_in)
    print(f"neuron venv {venv}: {describe(before)}", flush=True)
    asked = check_shadow(list(shadow), before["dists"], venv)
    env_python = make_env(env, venv, before)
    with tempfile.TemporaryDirectory(prefix="qwentitan-trn2-env-") as tmp:
        plan: Resolution = resolve(Path(tmp), env_python, before["dists"], venv, asked)
        uv(
            "pip", "sync", "--python", str(env_python), "--quiet",
            *[arg for name in plan.ours for arg in ("--reinstall-package", name)],
            str(plan.requirements),
        )  # fmt: skip
    env_found = probe(env_python, STACK_MODULES)
    check_after(venv, before, probe(python), env_found)
    env_site = set(env_found["site"])
    held = sorted(
        f"{d['name']} {d['version']}" for d in env_found["dists"].values() if d["site"] in env_site
    )
    return {
        "env": str(env),
        "venv": str(venv),
        "found": describe(before),
        "held": held,
        "shadowed": [(n, v, version_of(env_found, n)) for n, v in plan.shadowed],
        "automatic": [(n, version_of(before, n), version_of(env_found, n)) for n in plan.automatic],
        "numpy": version_of(env_found, "numpy"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def default_venv() -> Path | None:
    dlami = Path(SDK["DLAMI_VENV"])
    return dlami if dlami.is_dir() else None


def report(done: dict) -> str:
    shadowed = "; ".join(
        f"its {name} {mine} comes before the Neuron venv's {name} {theirs}"
        + (f" (AWS's fork {SDK['TORCHTITAN_FORK']}, left there)" if SDK["is_fork"](theirs) else "")
        for name, theirs, mine in done["shadowed"]
    )
    return (
        f"trn2 environment {done['env']}: {len(done['held'])} distributions the Neuron venv "
        f"lacks, installed in {done['seconds']} s; it imports the Neuron venv's packages "
        f"({done['found']}, numpy {done['numpy']}), unchanged"
        + (f"; {shadowed}" if shadowed else "")
        + "".join(
            f"\ntrn2 environment shadows {name} without --shadow: its {mine} in front of the "
            f"Neuron venv's {theirs}, which qwentitan cannot use and the venv's packages do not pin"
            for name, theirs, mine in done.get("automatic", ())
        )
        + f"\ntrn2 environment holds: {', '.join(done['held'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help=f"the Neuron venv (default {SDK['DLAMI_VENV']})")
    parser.add_argument("--env", type=Path, default=ROOT / ".venv-trn2", help="qwentitan's env")
    parser.add_argument(
        "--stand-in", action="store_true", help="accept a venv without the Neuron SDK's torch "
        "2.14.0 or torch-neuronx (a rehearsal off Trainium)"
    )  # fmt: skip
    parser.add_argument(
        "--shadow", action="append", default=[], metavar="NAME", help="let the environment hold "
        "its own NAME in front of the venv's, where qwentitan needs another version (repeatable; "
        "a conflict outside the Neuron stack is shadowed without it)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    venv = args.venv or default_venv()
    try:
        if venv is None:
            raise InstallError(
                f"No Neuron venv: {SDK['DLAMI_VENV']} does not exist here; pass --neuron-venv DIR."
            )
        done = install(
            venv.expanduser().absolute(),
            args.env.expanduser().absolute(),
            stand_in=args.stand_in,
            shadow=args.shadow,
        )
    except InstallError as error:
        print(f"neuron venv: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("neuron venv: interrupted (Ctrl-C); run it again.", file=sys.stderr)
        return 2
    print(report(done), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UV_NO_PROGRESS", "1")
    sys.exit(main())
