"""A rehearsal of the trn2 install: `nox -s train_trn2 -- --neuron-venv V --env E` beside a
stand-in Neuron venv V, which must come out as it went in (`tree_digest`: every file, its bytes or,
for the large ones, its size, time and inode).

V (one per test session, `neuron_venv`): Python 3.12 with PyPI's torch 2.14.0 (the Neuron SDK's
release; its CUDA libraries come along, where the DLAMI's CPU build has none), numpy 1.26.4, small
wheels named torch-neuronx, neuronx-cc (declaring `numpy<2`, as TorchNeuron's pyproject says
neuronx-cc needs) and nki, and AWS's TorchTitan fork as a wheel named torchtitan 0.2.2+neuron.1
holding `torchtitan` and `torchtitan_neuron`, and fsspec 2026.9.0. One install (`trn2_install`)
feeds the tests of the dry run; the refusals run scripts/neuron_venv.py on small venvs without
torch's weight.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "neuron_venv.py"
# name -> (version, top-level packages, requirements): the stand-ins installed beside PyPI's torch.
STAND_INS = {
    "torch-neuronx": ("2.14.3.1", ("torch_neuronx",), ()),
    "neuronx-cc": ("2.28.7631.0", ("neuronxcc",), ("numpy<2",)),
    "nki": ("0.7.0", ("nki",), ()),
    "torchtitan": ("0.2.2+neuron.1", ("torchtitan", "torchtitan_neuron"), ()),
}


@functools.cache
def pyenv_python(version: str) -> Path | None:
    """pyenv's newest install of `version`, else one uv finds on this machine, else None."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python{version}"))
    if found:
        return found[-1]
    if shutil.which("uv") is None:
        return None
    done = subprocess.run(
        ["uv", "python", "find", "--system", version], capture_output=True, text=True
    )
    return Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def make_wheel(
    folder: Path, name: str, version: str, modules: tuple[str, ...], requires: tuple[str, ...] = ()
) -> Path:
    """A minimal pure-Python wheel: each module an `__init__.py` with its `__version__`."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {f"{m}/__init__.py": f'__version__ = "{version}"\nSTAND_IN = True\n' for m in modules}
    files[f"{info}/METADATA"] = metadata + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
    files[f"{info}/WHEEL"] += "Tag: py3-none-any\n"
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


def make_venv(where: Path, python: Path, *requirements: str, stand_ins: dict = STAND_INS) -> Path:
    """A venv of `python` holding `stand_ins` as small wheels and `requirements` from the index."""
    venv = where / "neuron-venv"
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["uv", "venv", "--quiet", "--python", str(python), str(venv)], check=True)
    wheels = [make_wheel(where, name, *spec) for name, spec in stand_ins.items()]
    subprocess.run(
        ["uv", "pip", "install", "--quiet", "--python",
         str(venv / "bin/python"), *requirements, *map(str, wheels)],
        check=True,
    )  # fmt: skip
    return venv


# Files above this size (torch's and the CUDA libraries' shared objects: ~5 GB of V's 5.3 GB) are
# compared by size, modification time and inode instead of their sha256, which took 10 s per
# digest of V: a write changes the time, a replacement or a new link the inode.
HASHED_UP_TO = 2**20


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (bytecode included) by relative path: its sha256 up to
    HASHED_UP_TO bytes, else its size, modification time and inode; links by target."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            stat = path.stat()
            if stat.st_size > HASHED_UP_TO:
                out[key] = f"{stat.st_size} bytes, mtime {stat.st_mtime_ns}, inode {stat.st_ino}"
                continue
            with path.open("rb") as handle:
                out[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return out


def nox_train_trn2(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["uv", "run", "--locked", "nox", "-s", "train_trn2", "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        # Faster: nothing compiled at install (the host install compiles E). Nor by the run:
        # pip leaves the DLAMI's venv compiled, so its Python writes no bytecode there, while
        # this stand-in is not compiled (compiling torch would take minutes on CI).
        env={**_users_shell(), "UV_COMPILE_BYTECODE": "0", "PYTHONDONTWRITEBYTECODE": "1"},
    )


def _users_shell() -> dict[str, str]:
    """This environment as a user's shell has it: without the variables a nox session running
    these tests sets, with which `uv run` would sync that session's environment instead of the
    workspace's (and replace its installed wheels with the workspace's editable packages)."""
    return {
        k: v for k, v in os.environ.items() if k not in ("UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV")
    }


def install_script(*args: str) -> subprocess.CompletedProcess[str]:
    """scripts/neuron_venv.py run as the nox session runs it (standard library only)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True
    )


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("neuron_venv", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


needs_uv = pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH")
needs_312 = pytest.mark.skipif(pyenv_python("3.12") is None, reason="needs a Python 3.12")


@pytest.fixture(scope="session")
def neuron_venv(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("trn2-host")
    # fsspec: the newest release when this was written, which PyPI's torch brings along and
    # torchtitan 0.3.0 (datasets<4.8, fsspec<=2026.2.0) does not accept: E holds its own,
    # without --shadow, since no package of V pins it (torch asks for any fsspec).
    return make_venv(
        where, pyenv_python("3.12"), "torch==2.14.0", "numpy==1.26.4", "fsspec==2026.9.0"
    )


@pytest.fixture(scope="session")
def trn2_install(neuron_venv, tmp_path_factory) -> dict:
    """One `train_trn2 --stand-in --dry-run` beside V, no --shadow: its output, V before and
    after, E."""
    env = tmp_path_factory.mktemp("trn2-env") / "env"
    before = tree_digest(neuron_venv)
    start = time.perf_counter()
    done = nox_train_trn2(
        "--neuron-venv", str(neuron_venv), "--env", str(env), "--stand-in",
        "--recipe", "qwen3_4b_hf", "--dry-run",
    )  # fmt: skip
    seconds = time.perf_counter() - start
    return {"done": done, "before": before, "after": tree_digest(neuron_venv), "env": env,
            "seconds": seconds}  # fmt: skip


def env_python_says(env: Path, code: str) -> dict:
    done = subprocess.run(
        [str(env / "bin/python"), "-c", code], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@needs_uv
@needs_312
def test_the_dry_run_installs_beside_the_neuron_venv_and_prints_the_plan(trn2_install):
    done = trn2_install["done"]
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "torch-neuronx 2.14.3.1" in out  # it names the Neuron stack it found
    assert "comes before the Neuron venv's torchtitan 0.2.2+neuron.1 (AWS's fork" in out
    assert "comes before the Neuron venv's fsspec 2026.9.0" in out
    # fsspec conflicts, and no package of V pins it: shadowed without a flag, in one line
    (line,) = [line for line in out.splitlines() if "without --shadow" in line]
    assert line.startswith("trn2 environment shadows fsspec without --shadow: its 2026.")
    assert "the Neuron venv's 2026.9.0" in line
    assert "qwen3_4b_hf" in out and "trn2.48xlarge" in out  # the plan


@pytest.mark.slow
@needs_uv
@needs_312
def test_the_neuron_venv_is_byte_for_byte_the_same(trn2_install):
    before, after = trn2_install["before"], trn2_install["after"]
    assert len(before) > 1000  # torch and its libraries: the digest saw the whole venv
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())[:10]
    assert after == before


@pytest.mark.slow
@needs_uv
@needs_312
def test_the_env_imports_the_neuron_venvs_stack_and_upstream_torchtitan(trn2_install, neuron_venv):
    said = env_python_says(
        trn2_install["env"],
        "import json, importlib.metadata as md, numpy, torch, torch_neuronx, neuronxcc, nki, "
        "torchtitan, torchtitan_neuron\n"
        "print(json.dumps({m.__name__: m.__file__ for m in (numpy, torch, torch_neuronx, "
        "neuronxcc, nki, torchtitan, torchtitan_neuron)} | {'numpy_version': numpy.__version__, "
        "'torch_version': md.version('torch'), 'torchtitan_version': md.version('torchtitan')}))",
    )
    assert said["numpy_version"] == "1.26.4" and said["torch_version"] == "2.14.0"
    for module in ("numpy", "torch", "torch_neuronx", "neuronxcc", "nki", "torchtitan_neuron"):
        assert said[module].startswith(str(neuron_venv)), (module, said[module])
    assert said["torchtitan_version"] == "0.3.0"
    assert said["torchtitan"].startswith(str(trn2_install["env"]))


@pytest.mark.slow
@needs_uv
@needs_312
def test_the_env_holds_only_what_the_neuron_venv_lacks(trn2_install, neuron_venv):
    def listed(python: Path) -> dict[str, str]:
        text = subprocess.run(
            ["uv", "pip", "list", "--python", str(python), "--format", "json"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(text)}

    venv, env = listed(neuron_venv / "bin/python"), listed(trn2_install["env"] / "bin/python")
    assert set(venv) & set(env) == {"torchtitan", "fsspec"}  # both shadowed, named in the output
    assert env["torchtitan"] == "0.3.0" and venv["torchtitan"] == "0.2.2+neuron.1"
    assert {"qwentitan-launch", "transformers", "mlflow"} <= set(env)
    assert env["transformers"] == "5.16.0"  # V has none: the AWS guide's release
    neuron_stack = {"torch", "torch-neuronx", "neuronx-cc", "nki", "numpy"}
    assert not [n for n in env if n in neuron_stack or n.startswith(("nvidia-", "triton", "cuda-"))]


def test_the_shadowing_pth_puts_the_env_first(tmp_path):
    """What E's .pth does, on a plain venv: the folder it names comes after E's own, and its
    own .pth files are read."""
    v_site, e_site = tmp_path / "v", tmp_path / "e"
    for site, version in ((v_site, "0.2.2+neuron.1"), (e_site, "0.3.0")):
        (site / "torchtitan").mkdir(parents=True)
        (site / "torchtitan" / "__init__.py").write_text(f"VERSION = {version!r}\n")
    (v_site / "extra").mkdir()
    (v_site / "extra" / "only_in_v.py").write_text("HERE = True\n")
    (v_site / "editable.pth").write_text(str(v_site / "extra") + "\n")
    (e_site / "_qwentitan_neuron_venv.pth").write_text(
        f"import site; site.addsitedir({str(v_site)!r})\n"
    )
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); import torchtitan, only_in_v; "
        "print(torchtitan.VERSION, only_in_v.HERE)"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(e_site)], capture_output=True, text=True
    )
    assert done.stdout.split() == ["0.3.0", "True"], done.stderr


@needs_uv
@pytest.mark.skipif(pyenv_python("3.11") is None, reason="needs a Python 3.11")
def test_a_python_311_venv_is_refused_naming_312(tmp_path):
    venv = make_venv(tmp_path, pyenv_python("3.11"))
    before = tree_digest(venv)

    done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))

    assert done.returncode == 2
    message = done.stderr.strip().splitlines()
    assert len(message) == 1 and "3.12-3.14" in message[0] and "Python 3.11" in message[0]
    assert tree_digest(venv) == before and not (tmp_path / "env").exists()


@needs_uv
@needs_312
@pytest.mark.parametrize(
    ("stand_ins", "named"),
    [
        ({"torch": ("2.13.0", ("torch",), ()), "torch-neuronx": STAND_INS["torch-neuronx"]},
         ["torch 2.13.0", "2.14.0", "--stand-in"]),
        ({"torch": ("2.14.0", ("torch",), ())}, ["no torch-neuronx", "--stand-in"]),
        ({"torch-neuronx": STAND_INS["torch-neuronx"]}, ["has no torch", "pip install"]),
    ],
)  # fmt: skip
def test_a_venv_off_the_documented_stack_is_refused(tmp_path, stand_ins, named):
    venv = make_venv(tmp_path, pyenv_python("3.12"), stand_ins=stand_ins)

    done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))

    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert all(word in done.stderr for word in named), done.stderr


@needs_uv
@needs_312
def test_stand_in_lets_a_rehearsal_venv_through_the_stack_checks(tmp_path):
    stand_ins = {"torch": ("2.14.1", ("torch",), ())}
    venv = make_venv(tmp_path, pyenv_python("3.12"), stand_ins=stand_ins)
    script = load_script()
    with pytest.raises(script.InstallError, match=r"torch 2\.14\.1"):
        script.check_venv(venv, stand_in=False)
    python, found = script.check_venv(venv, stand_in=True)
    assert python == venv / "bin/python" and found["dists"]["torch"]["version"] == "2.14.1"


def test_what_is_not_a_venv_is_refused_in_one_sentence(tmp_path):
    talker = tmp_path / "talker"
    (talker / "bin").mkdir(parents=True)
    (talker / "bin" / "python").write_text("#!/bin/sh\necho hello from a shell script\n")
    (talker / "bin" / "python").chmod(0o755)
    inert = tmp_path / "inert"
    (inert / "bin").mkdir(parents=True)
    (inert / "bin" / "python").write_text("not a program\n")
    installation = Path(sys.base_prefix)  # a Python, but no venv

    for venv, named in (
        (talker, "did not answer as a Python venv does"),
        (inert, "is not an executable Python"),
        (tmp_path / "absent", "is not an executable Python"),
        (installation, "not a venv"),
    ):
        done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert named in done.stderr and "--neuron-venv" in done.stderr


TAGGED = '{"probe": "qwentitan-neuron-venv-probe/1"'


@pytest.mark.parametrize(
    "prints",
    [
        b"\xff\xfe not UTF-8",  # bytes no decoder takes
        TAGGED.encode() + b"}",  # the tag, nothing else
        TAGGED.encode() + b', "python": "3.12", "prefix": "/v", "base_prefix": "/b", '
        b'"base_executable": "", "site": [], "dists": {}, "modules": {}}',  # a version as text
        TAGGED.encode() + b', "python": [3, 12, 1], "prefix": "/v", "base_prefix": "/b", '
        b'"base_executable": "", "site": [], "dists": {"torch": "2.14.0"}, "modules": {}}',
        b"[3, 12, 1]",  # JSON, not the answer
    ],
    ids=["not UTF-8", "only the tag", "python as text", "a dist as text", "a list"],
)
def test_a_bin_python_that_prints_something_else_is_one_sentence(tmp_path, prints):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "prints").write_bytes(prints + b"\n")
    (venv / "bin" / "python").write_text(f"#!/bin/sh\ncat {venv / 'prints'}\n")
    (venv / "bin" / "python").chmod(0o755)
    done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "did not answer as a Python venv does" in done.stderr
    assert not (tmp_path / "env").exists()


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o000])
def test_a_bin_python_that_is_not_executable_is_one_sentence(tmp_path, mode):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho hello\n")
    (venv / "bin" / "python").chmod(mode)
    done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "is not an executable Python" in done.stderr


@needs_uv
@needs_312
def test_an_env_folder_that_is_not_an_earlier_install_or_overlaps_the_venv_is_refused(tmp_path):
    stand_ins = {"torch": ("2.14.0", ("torch",), ()), "torch-neuronx": STAND_INS["torch-neuronx"]}
    venv = make_venv(tmp_path, pyenv_python("3.12"), stand_ins=stand_ins)
    other = tmp_path / "workspace-venv"  # a venv this install did not make, like `.venv`
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(other)], check=True)
    before = tree_digest(other)
    for env, named in ((other, "no environment this install made"),
                       (venv / "env", "overlaps the Neuron venv")):  # fmt: skip
        done = install_script("--venv", str(venv), "--env", str(env))
        assert done.returncode == 2 and named in done.stderr, done.stderr
    assert tree_digest(other) == before and not (venv / "env").exists()


@pytest.mark.slow
@needs_uv
@needs_312
def test_a_package_the_neuron_stack_pins_at_a_version_qwentitan_refuses_is_named(tmp_path):
    # rich: qwentitan's dependencies need rich>=13, the venv holds 12.0.0, and its torch-neuronx
    # (a stand-in) requires rich<13: E cannot hold its own, so the install stops in one sentence.
    stand_ins = {
        "torch": ("2.14.0", ("torch",), ()),
        "torch-neuronx": (*STAND_INS["torch-neuronx"][:2], ("rich<13",)),
        "rich": ("12.0.0", ("rich",), ()),
    }
    venv = make_venv(tmp_path, pyenv_python("3.12"), stand_ins=stand_ins)
    before = tree_digest(venv)

    done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"))

    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("neuron venv: rich conflicts:"), done.stderr[-2000:]
    assert "needs rich>=13" in last and "rich 12.0.0" in last and str(venv) in last
    assert "torch-neuronx (rich<13)" in last and "--shadow" not in last
    assert last.count(". ") == 0, "one sentence"
    assert tree_digest(venv) == before


@needs_uv
@needs_312
def test_shadow_refuses_the_neuron_stack_and_what_the_venv_lacks(tmp_path):
    stand_ins = {"torch": ("2.14.0", ("torch",), ()), "torch-neuronx": STAND_INS["torch-neuronx"]}
    venv = make_venv(tmp_path, pyenv_python("3.12"), stand_ins=stand_ins)
    for name, named in (("torch-neuronx", "never holds its own torch-neuronx"),
                        ("rich", "holds no rich")):  # fmt: skip
        done = install_script("--venv", str(venv), "--env", str(tmp_path / "env"), "--shadow", name)
        assert (
            done.returncode == 2 and named in done.stderr and f"drop --shadow {name}" in done.stderr
        )
    assert not (tmp_path / "env").exists()


def test_a_bin_python_that_never_answers_is_one_sentence_and_ends_with_its_children(
    tmp_path, monkeypatch
):
    """A hung python (and what it started) is ended after the probe's deadline, said in one
    short sentence (the probe's whole script once came back in the message)."""
    import time

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    pids = tmp_path / "pids"
    (venv / "bin" / "python").write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pids}\nsleep 300\n")
    (venv / "bin" / "python").chmod(0o755)
    script = load_script()
    monkeypatch.setattr(script, "PROBE_TIMEOUT_S", 2)
    started = time.monotonic()
    with pytest.raises(script.InstallError) as error:
        script.probe(venv / "bin" / "python")
    assert time.monotonic() - started < 30
    said = str(error.value)
    assert said.startswith(f"{venv / 'bin' / 'python'} did not answer within 2 s (it and what ")
    assert "\n" not in said and len(said) < 400, said
    child = int(pids.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the hung python's child outlived the probe")
