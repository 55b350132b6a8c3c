"""What the trn2 environment E must hold beside a Neuron venv V: qwentitan's four wheels resolved
with every distribution V holds kept at V's version (step 3 of scripts/neuron_venv.py).

uv resolves against two indexes: first a local one offering, for each distribution V holds, one
metadata-only wheel with V's name, version and requirements (uv takes a package from the first
index that has it, so PyPI is never asked for torch, its CUDA libraries or the Neuron packages),
then the default index for the rest. Constraints pin V's versions as well, and transformers to
the AWS guide's release where V has none. What the resolution names and V lacks is E's list.

Standard library only, like neuron_venv.py.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
SDK = runpy.run_path(str(ROOT / "packages/launch/src/qwentitan/launch/base/neuron_sdk.py"))
QWENTITAN = ("qwentitan-kernels", "qwentitan-modeling", "qwentitan-checkpoint", "qwentitan-launch")


class InstallError(Exception):
    """One sentence naming the fix."""


@dataclass
class Resolution:
    """E's exact list, and what of V it puts first."""

    requirements: Path
    ours: list[str] = field(default_factory=lambda: list(QWENTITAN))
    shadowed: list[tuple[str, str]] = field(default_factory=list)  # (name, V's version)
    automatic: list[str] = field(default_factory=list)  # names shadowed without --shadow


def uv(*args: str, capture: bool = False) -> str:
    done = subprocess.run(["uv", *args], cwd=ROOT, text=True, capture_output=capture, check=False)
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] if capture else []
        raise InstallError(f"`uv {args[0]} {args[1]}` failed {detail or ''}; see its output above.")
    return done.stdout or ""


def build_wheels(out: Path) -> list[Path]:
    uv("build", "--all-packages", "--wheel", "--out-dir", str(out), "--quiet")
    wheels = sorted(out.glob("qwentitan_*.whl"))
    if len(wheels) != len(QWENTITAN):
        raise InstallError(f"uv build made {len(wheels)} qwentitan wheels, not 4; see above.")
    return wheels


def shadowed(dists: dict[str, dict]) -> dict[str, str]:
    """V's distributions E puts its own before: qwentitan's, and a torchtitan that is not
    upstream's release (AWS's fork): normalized name -> V's version."""
    names = [*QWENTITAN, "torchtitan"]
    out = {key: dists[key]["version"] for key in names if key in dists}
    if out.get("torchtitan") == SDK["TORCHTITAN_UPSTREAM"]:
        del out["torchtitan"]
    return out


def stub_wheel(folder: Path, dist: dict) -> Path:
    """A wheel holding only `dist`'s metadata as V has it: name, version, requirements."""
    stem = re.sub(r"[-_.]+", "_", dist["name"].lower())
    version = dist["version"].replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {dist['name']}", f"Version: {dist['version']}"]
    if dist["requires_python"]:
        meta.append(f"Requires-Python: {dist['requires_python']}")
    meta += [f"Provides-Extra: {extra}" for extra in dist["extras"]]
    meta += [f"Requires-Dist: {requirement}" for requirement in dist["requires"]]
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", "\n".join(meta) + "\n")
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: qwentitan\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def local_index(folder: Path, dists: dict[str, dict]) -> str:
    """A simple-repository index (PEP 503) of V's distributions as metadata-only wheels."""
    for key, dist in dists.items():
        wheel = stub_wheel(folder / key, dist)
        (folder / key / "index.html").write_text(
            f'<a href="{quote(wheel.name)}">{wheel.name}</a>\n'
        )
    (folder / "index.html").write_text("".join(f'<a href="{key}/">{key}</a>\n' for key in dists))
    return folder.as_uri()


_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
# One clause of uv's explanation of a failed resolution: "datasets>=4.6.0,<=4.7.0 depends on
# fsspec[http]>=2023.1.0,<=2026.2.0", "all versions of torch depend on fsspec==2026.9.0".
_DEPENDS = re.compile(r"(\S+) depends? on ([A-Za-z0-9][\w.-]*?)(?:\[[^\]]*\])?([<>=!~]\S*)")


def _clauses(stderr: str) -> list[tuple[str, str, str, str]]:
    """(who, normalized name, name, spec) of each "X depends on NAME SPEC" uv explains."""
    return [
        (who, SDK["normalize"](name), name, spec.rstrip(",."))
        for who, name, spec in _DEPENDS.findall(" ".join(stderr.split()))
    ]


def conflicting(stderr: str, pinned: dict[str, str]) -> str | None:
    """The normalized name of the pinned package uv's failed resolution needs otherwise."""
    needs = [c for c in _clauses(stderr) if c[1] in pinned and c[3] != f"=={pinned[c[1]]}"]
    return needs[-1][1] if needs else None


def conflict(
    stderr: str,
    pinned: dict[str, str],
    venv: Path,
    in_venv: set[str],
    constrained_by: list[str] = (),
) -> str:
    """uv's failed resolution as one sentence: the package, who needs what, what V holds, the fix.

    `constrained_by`: what V's own packages require of it, which kept the trn2 environment from
    holding another version in front of V's."""
    clauses = _clauses(stderr)
    # The needs on a pinned package other than the pin itself, which uv restates as a need.
    needs = [c for c in clauses if c[1] in pinned and c[3] != f"=={pinned[c[1]]}"]
    if not needs:
        cause = next((line.strip() for line in stderr.splitlines() if "Because" in line), "")
        cause = cause or (stderr.strip().splitlines() or ["no output"])[-1].strip()
        return (
            f"uv found no versions that keep the packages of {venv} as they are ({cause[:300]}); "
            "see `uv pip compile`'s explanation above and adjust that venv or report it."
        )
    who, key, name, spec = needs[-1]  # uv explains from the oldest versions to the newest
    who_name = SDK["normalize"](_NAME.match(who).group(1))
    via = next((w for w, k, _, _ in clauses if k == who_name and w != who), None)
    needer = who + (f" (required by {via})" if via else "")
    if SDK["is_protected"](name):
        fix = f"install the documented Neuron SDK stack in {venv} (README, 'On the trn2 host')"
    elif constrained_by and key in in_venv:
        return (
            f"{name} conflicts: {needer} needs {name}{spec}, but the Neuron venv {venv} holds "
            f"{name} {pinned[key]} and its {', '.join(constrained_by)} rule out any other, so the "
            f"trn2 environment cannot hold its own; install a {name} that both accept in the "
            "venv, or report it."
        )
    else:
        fix = (
            f"pass --shadow {name} to let the trn2 environment hold its own {name} in front of "
            f"the venv's (the venv stays as it is), or install a matching {name} in the venv yourself"
        )
    if key not in in_venv:  # transformers, which the Neuron venv lacks
        return (
            f"{name} conflicts: {needer} needs {name}{spec}, but the install takes the AWS "
            f"guide's {name} {pinned[key]} where the Neuron venv has none; report it."
        )
    return (
        f"{name} conflicts: {needer} needs {name}{spec}, but the Neuron venv {venv} holds "
        f"{name} {pinned[key]}, which the trn2 environment keeps; {fix}."
    )


def requirements_on(dists: dict[str, dict], key: str) -> list[str]:
    """What V's distributions require of `key` (extras' requirements left out), extras
    stripped: the constraints a version of `key` in E must meet so V's packages still accept it."""
    out = []
    for dist in dists.values():
        for requirement in dist["requires"]:
            found = _NAME.match(requirement)
            if found is None or SDK["normalize"](found.group(1)) != key:
                continue
            if "extra" not in requirement.partition(";")[2]:
                out.append(re.sub(r"^([^\[;<>=!~ ]+)\s*\[[^\]]*\]", r"\1", requirement))
    return out


def _constraints(dists: dict[str, dict], offered: dict[str, dict], asked: list[str]) -> list[str]:
    """V's versions of what E does not shadow, what V requires of what E shadows on request, and
    transformers as the AWS guide tested it where V has none."""
    lines = [f"{d['name']}=={d['version']}" for d in offered.values()]
    lines += [r for key in asked for r in requirements_on(offered, key)]
    if "transformers" not in dists:
        lines.append(f"transformers=={SDK['TRANSFORMERS']}")
    return lines


def check_shadow(asked: list[str], dists: dict[str, dict], venv: Path) -> list[str]:
    """The normalized names of `--shadow`, refused when one is the Neuron stack or not in V."""
    keys = [SDK["normalize"](name) for name in asked]
    for name, key in zip(asked, keys, strict=True):
        if SDK["is_protected"](name):
            raise InstallError(
                f"--shadow {name}: the trn2 environment never holds its own {name}, which "
                f"must be the Neuron venv's; drop --shadow {name}."
            )
        if key not in dists:
            raise InstallError(f"--shadow {name}: {venv} holds no {name}; drop --shadow {name}.")
    return keys


def constraints_on(dists: dict[str, dict], key: str) -> list[str]:
    """ "DIST (REQUIREMENT)" for each distribution of V that requires `key` with a version range."""
    return [
        f"{dist['name']} ({requirement})"
        for dist in dists.values()
        for requirement in requirements_on({"-": dist}, key)
        if re.search(r"[<>=!~]", requirement)
    ]


def resolve(
    tmp: Path, env_python: Path, dists: dict[str, dict], venv: Path, asked: list[str] = ()
) -> Resolution:
    """Resolve qwentitan's wheels for E's Python with V's distributions fixed, except the
    normalized names `asked` (checked by `check_shadow`); E's list.

    A conflict on a package of V outside the Neuron stack is shadowed without a flag: the
    resolution runs again with E free to hold its own version, still within everything V's
    packages require of it (`_constraints`), so V's torch, torch-neuronx, neuronx-cc and nki keep
    accepting what they import. Where those requirements leave no version, the first conflict is
    the one sentence, naming them."""
    wheels = build_wheels(tmp / "wheels")
    automatic: list[str] = []
    first: dict[str, _Unresolved] = {}  # each automatic shadow's conflict, for the sentence
    while True:
        shadow_keys = [*asked, *automatic]
        try:
            plan = _resolve_once(tmp, env_python, dists, venv, shadow_keys, wheels)
        except _Unresolved as failed:
            key = conflicting(failed.stderr, failed.pinned)
            movable = key in dists and not SDK["is_protected"](key) and key not in shadow_keys
            if movable:
                first[key] = failed
                automatic.append(key)
                continue
            if key is None and automatic:  # E may hold its own, but V's packages pin it
                last = automatic[-1]
                cause = first[last]
                needs = constraints_on(dists, last) or [f"requirements on {last}"]
                raise InstallError(
                    conflict(cause.stderr, cause.pinned, venv, set(dists), needs)
                ) from None
            print(failed.stderr.strip(), flush=True)
            raise InstallError(conflict(failed.stderr, failed.pinned, venv, set(dists))) from None
        plan.automatic = [dists[k]["name"] for k in automatic]
        return plan


class _Unresolved(Exception):
    def __init__(self, stderr: str, pinned: dict[str, str]) -> None:
        super().__init__(stderr)
        self.stderr, self.pinned = stderr, pinned


def _resolve_once(
    tmp: Path,
    env_python: Path,
    dists: dict[str, dict],
    venv: Path,
    asked: list[str],
    wheels: list[Path],
) -> Resolution:
    """One `uv pip compile` with V's distributions fixed except `asked`; _Unresolved if none."""
    shadow = shadowed(dists) | {key: dists[key]["version"] for key in asked}
    offered = {key: dist for key, dist in dists.items() if key not in shadow}
    pinned = {key: dist["version"] for key, dist in offered.items()}
    pinned.setdefault("transformers", SDK["TRANSFORMERS"])
    (tmp / "constraints.txt").write_text("\n".join(_constraints(dists, offered, asked)) + "\n")
    ordered = zip(QWENTITAN, _ordered(wheels), strict=True)
    (tmp / "wheels.txt").write_text("".join(f"{n} @ {w.as_uri()}\n" for n, w in ordered))
    resolved = tmp / "resolved.txt"  # what it holds, uv prefers: V's versions of what E may shadow
    resolved.write_text("".join(f"{dists[k]['name']}=={dists[k]['version']}\n" for k in asked))
    index = tmp / f"index-{len(asked)}"
    done = subprocess.run(
        ["uv", "pip", "compile", "--python", str(env_python), "--quiet", "--no-header",
         "--no-annotate", "--index", local_index(index, offered),
         "-c", str(tmp / "constraints.txt"), str(tmp / "wheels.txt"), "-o", str(resolved)],
        cwd=ROOT, text=True, capture_output=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise _Unresolved(done.stderr, pinned)
    lines = [line.strip() for line in resolved.read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", "-"))]
    keep = [line for line in lines if SDK["normalize"](_NAME.match(line).group(1)) not in offered]
    bad = [line for line in keep if SDK["is_protected"](_NAME.match(line).group(1))]
    if bad:  # only a venv whose own packages miss what they require gets here
        raise InstallError(
            f"qwentitan would need {bad[0].split(' @ ')[0]} in the trn2 environment, which must "
            f"come from the Neuron venv {venv}; install the Neuron SDK's packages there completely."
        )
    (tmp / "trn2-env.txt").write_text("\n".join(keep) + "\n")
    names = {SDK["normalize"](_NAME.match(line).group(1)): line for line in keep}
    return Resolution(
        tmp / "trn2-env.txt",
        shadowed=[(dists[k]["name"], v) for k, v in sorted(shadow.items()) if k in names],
    )


def _ordered(wheels: list[Path]) -> list[Path]:
    """The built wheels in QWENTITAN's order (their file names start with the name's stem)."""
    by_stem = {wheel.name.split("-")[0]: wheel for wheel in wheels}
    return [by_stem[name.replace("-", "_")] for name in QWENTITAN]
