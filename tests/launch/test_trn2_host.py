"""The trn2 host as AWS documents it, through stand-ins on CPU: the Neuron SDK stack and the
imported torchtitan, the dataset read offline, EFA, and the weights download (`fetch`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qwentitan.launch.base import neuron_sdk
from qwentitan.launch.launcher.cli import main
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.preflight.dataset import check_dataset, tokens
from qwentitan.launch.launcher.preflight.efa import check_efa, efa_devices, fi_info_endpoints
from qwentitan.launch.launcher.preflight.neuron_stack import check_neuron_stack, installed_version
from qwentitan.launch.launcher.preflight.weights import check_weights
from qwentitan.launch.recipes import TRN2_RECIPES

DOCUMENTED = {
    "torch": "2.14.0",
    "torch-neuronx": "2.14.3.0",
    "neuronx-cc": "2.21.33.0",
    "nki": "0.3.0",
    "torchtitan": "0.3.0",
}


@pytest.fixture(scope="module")
def trn2_plan():
    return resolve_plan(RunRequest(recipe="qwen3_4b_native"))


def fake_distributions(site: Path, versions: dict[str, str]) -> None:
    """dist-info folders that importlib.metadata finds, as an installed wheel leaves them."""
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_documented_neuron_stack_passes_from_installed_metadata(
    trn2_plan, tmp_path, monkeypatch
):
    fake_distributions(tmp_path, DOCUMENTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_version("torch-neuronx") == "2.14.3.0"

    result = check_neuron_stack(trn2_plan, on_neuron_host=True, python=(3, 13, 0))

    assert result.status == "pass", result.detail
    assert result.detail.startswith("Neuron SDK 2.33 stack: ")
    assert "torch 2.14.0, torch-neuronx 2.14.3.0, neuronx-cc 2.21.33.0, nki 0.3.0" in result.detail
    assert "qwentitan runs torchtitan 0.3.0 from " in result.detail


def test_the_newest_documented_stack_is_the_default_and_both_pass(trn2_plan):
    assert neuron_sdk.SDK_VERSION == "2.34" and neuron_sdk.SDK_VERSIONS == ("2.34", "2.33")
    for torch_neuronx, sdk in (("2.14.3.1.96", "2.34"), ("2.14.3.0.12", "2.33")):
        versions = {**DOCUMENTED, "torch-neuronx": torch_neuronx, "torch": "2.14.0+cpu"}
        result = check_neuron_stack(
            trn2_plan, on_neuron_host=True, version_of=versions.get, python=(3, 12, 1),
            installs=lambda: [("0.3.0", "/env/site-packages")],
        )  # fmt: skip
        assert result.status == "pass" and result.figures["neuron_sdk"] == sdk, result.detail


def test_a_fork_the_neuron_venv_holds_behind_upstream_passes_with_a_note(trn2_plan):
    installs = [("0.3.0", "/srv/.venv-trn2/lib/python3.12/site-packages"),
                ("0.2.2+neuron.1", "/opt/venv/lib/python3.12/site-packages")]  # fmt: skip
    result = check_neuron_stack(
        trn2_plan, on_neuron_host=True, version_of=DOCUMENTED.get, python=(3, 12, 1),
        installs=lambda: installs,
    )  # fmt: skip
    assert result.status == "pass", result.detail
    assert "qwentitan runs torchtitan 0.3.0 from " in result.detail
    assert "AWS's fork aws-neuron/torchtitan-neuron 0.2.2+neuron.1 in /opt/venv" in result.detail


@pytest.mark.parametrize(
    ("change", "python", "named"),
    [
        ({"torch": "2.14.1"}, (3, 12, 1), "torch 2.14.1 (documented: 2.14.0*)"),
        ({"torch-neuronx": "2.13.3.0"}, (3, 12, 1), "torch-neuronx 2.13.3.0"),
        ({"nki": None}, (3, 12, 1), "nki missing"),
        ({}, (3, 11, 7), "Python 3.11.7 (Neuron wheels: 3.12-3.14)"),
        ({"torchtitan": "0.2.2+neuron.1"}, (3, 12, 1), "nox -s train_trn2"),
    ],
)
def test_a_stack_off_the_documented_pairs_fails_naming_it(trn2_plan, change, python, named):
    versions = {**DOCUMENTED, **change}
    result = check_neuron_stack(
        trn2_plan, on_neuron_host=True, version_of=versions.get, python=python
    )
    assert result.status == "fail" and named in result.detail, result.detail


def test_the_stack_is_only_reported_off_a_neuron_host(trn2_plan):
    result = check_neuron_stack(trn2_plan, on_neuron_host=False, version_of={}.get)
    assert result.status == "skip" and "torch-neuronx missing" in result.detail


def _os_release(tmp_path: Path, version: str) -> Path:
    path = tmp_path / f"os-release-{version}"
    path.write_text(
        f'NAME="Ubuntu"\nID=ubuntu\nVERSION_ID="{version}"\nPRETTY_NAME="Ubuntu {version} LTS"\n'
    )
    return path


@pytest.mark.parametrize(
    ("version", "packages", "status"),
    [
        ("26.04", "/home/ubuntu/neuron-venv/lib/python3.12/site-packages/torch_neuronx", "pass"),
        ("24.04", "/home/ubuntu/neuron-venv/lib/python3.12/site-packages/torch_neuronx", "warn"),
        ("24.04", "/opt/aws_neuronx_venv_torch_neuronx_2_14_0/lib/python3.12/site-packages/torch_neuronx", "pass"),
    ],
)  # fmt: skip
def test_the_host_os_is_reported_and_a_manual_route_off_ubuntu_26_04_warns(
    trn2_plan, tmp_path, version, packages, status
):
    from qwentitan.launch.launcher.preflight.host_os import check_host_os

    release = _os_release(tmp_path, version)
    result = check_host_os(
        trn2_plan, on_neuron_host=True, os_release=release, origin=lambda: packages
    )
    assert result.status == status, result.detail
    assert result.detail.startswith(f"Ubuntu {version} LTS")
    assert result.figures["route"] == ("dlami" if packages.startswith("/opt/") else "manual")
    if status == "warn":
        assert "Ubuntu 26.04" in result.detail and "Deep Learning AMI" in result.detail
    off_host = check_host_os(trn2_plan, on_neuron_host=False, os_release=release)
    assert off_host.status == "skip" and f"Ubuntu {version} LTS" in off_host.detail


def test_preflight_names_the_spmd_backend_and_the_forks_way(trn2_plan):
    from qwentitan.launch.launcher.preflight.host_os import check_spmd_backend

    result = check_spmd_backend(trn2_plan)
    assert result.figures["spmd_backend"] == "spmd_types", "torchtitan 0.3.0's default is kept"
    assert "--parallelism.spmd_backend partial_dtensor" in result.detail
    hf = check_spmd_backend(resolve_plan(RunRequest(recipe="qwen3_4b_hf")))
    assert hf.figures["spmd_backend"] == "partial_dtensor" and "--" not in hf.detail


def test_the_versions_file_is_the_documented_matrix():
    assert neuron_sdk.python_supported((3, 12, 1)) and neuron_sdk.python_supported((3, 14, 0))
    assert not neuron_sdk.python_supported((3, 11, 7))
    assert all(neuron_sdk.is_protected(n) for n in ("torch", "Torch_Neuronx", "nvidia-nccl-cu13"))
    assert not neuron_sdk.is_protected("torchtitan")
    assert neuron_sdk.matches("2.14.0+cpu", "2.14.0") and neuron_sdk.matches("2.28.1.0", "2")
    assert not neuron_sdk.matches("2.14.3.10", "2.14.3.1")
    assert neuron_sdk.is_fork("0.2.2+neuron.2") and not neuron_sdk.is_fork("0.3.0")


def test_the_neuron_pair_group_is_the_documented_torch_and_transformers():
    """`nox -s tests-3.13` runs pyproject's neuron-pair group; it must be neuron_sdk's pair."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pair = project["dependency-groups"]["neuron-pair"]
    assert pair == [f"torch=={neuron_sdk.TORCH}", f"transformers=={neuron_sdk.TRANSFORMERS}"]


def test_compile_with_the_nki_kernels_on_neuron_is_refused_at_plan_time(capsys, monkeypatch):
    monkeypatch.delenv("QWENTITAN_KERNELS", raising=False)
    args = ["plan", "--recipe", "qwen3_moe_kernels", "--", "--compile.enable"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "nki_op" in err and "eager" in err and "drop --compile.enable" in err
    assert "Neuron SDK 2.33" in err
    assert "(grouped_experts, rope)" in err
    # eager, or compiled with the reference twins (plain PyTorch ops), plans as before
    assert main(["plan", "--recipe", "qwen3_moe_kernels"]) == 0
    monkeypatch.setenv("QWENTITAN_KERNELS", "rope=reference,experts=reference")
    assert main(args) == 0
    assert "torch.compile, backend neuron" in capsys.readouterr().out


def test_compile_with_the_nki_kernels_plans_where_torch_neuronx_has_nki_op(capsys, monkeypatch):
    # A torch-neuronx with nki_op (SDK 2.33+): the ops' NKI implementations are registered
    # through it, the documented way to run NKI kernels inside torch.compile(backend="neuron").
    import types

    monkeypatch.delenv("QWENTITAN_KERNELS", raising=False)
    fake = types.ModuleType("torch_neuronx")
    fake.__version__, fake.nki_op = "2.14.3.1", lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    assert main(["plan", "--recipe", "qwen3_moe_kernels", "--", "--compile.enable"]) == 0
    assert "torch.compile, backend neuron" in capsys.readouterr().out
    del fake.nki_op  # an older torch-neuronx: refused as above
    assert main(["plan", "--recipe", "qwen3_moe_kernels", "--", "--compile.enable"]) == 2


@pytest.mark.parametrize("recipe", TRN2_RECIPES)
def test_every_trn2_recipe_reads_its_dataset_on_the_host_offline(recipe):
    plan = resolve_plan(RunRequest(recipe=recipe))
    result = check_dataset(plan)
    assert result.status == "pass", result.detail
    assert result.figures["first_batch"][-1] == plan.seq_len


def test_a_tiny_run_reads_its_tokens_in_a_unit_that_shows_them():
    """Issue 56: 3 steps of a tiny run read 3,072 tokens, not "0.0M"."""
    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=2, steps=3))
    result = check_dataset(plan)
    assert result.status == "pass" and "the run reads 3,072 tokens (3 steps x 8 x 128), " in (
        result.detail
    ), result.detail
    assert re.search(r"\(3 steps x 8 x 128\), 0\.\d\d% of it$", result.detail), result.detail
    assert [tokens(n) for n in (999, 1_600_000, 2_140_000_000)] == [
        "999 tokens",
        "1.6M tokens",
        "2.1B tokens",
    ]


@pytest.mark.parametrize("dataset", ["c4_test", "allenai/c4"])
def test_data_that_is_not_on_the_host_fails_offline(dataset):
    plan = resolve_plan(
        RunRequest(recipe="qwen3_4b_hf", overrides=["--dataloader.dataset", dataset])
    )
    result = check_dataset(plan)
    assert result.status == "fail" and "64 ranks" in result.detail and dataset in result.detail


def efa_sysfs(root: Path, drivers: dict[str, str]) -> Path:
    """A stand-in /sys/class/infiniband: device -> its driver (a symlink, as sysfs has it)."""
    for device, driver in drivers.items():
        (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (root / "class" / device / "device").mkdir(parents=True)
        (root / "class" / device / "device" / "driver").symlink_to(root / "drivers" / driver)
    return root / "class"


def test_efa_is_checked_on_a_multi_node_plan(tmp_path):
    plan = resolve_plan(RunRequest(recipe="qwen3_4b_native", nodes=2, rdzv_endpoint="node0:29500"))
    sysfs = efa_sysfs(tmp_path, {"rdmap16s27": "efa", "rdmap32s27": "efa", "mlx5_0": "mlx5_core"})
    assert efa_devices(sysfs) == ["rdmap16s27", "rdmap32s27"]

    good = check_efa(plan, on_target_host=True, root=sysfs, endpoints=lambda: 2)
    assert good.status == "pass" and "2 EFA device(s)" in good.detail and "2 RDM" in good.detail
    none = check_efa(plan, on_target_host=True, root=tmp_path / "absent", endpoints=lambda: None)
    assert none.status == "fail" and "2-node run needs EFA on every node" in none.detail
    zero = check_efa(plan, on_target_host=True, root=sysfs, endpoints=lambda: 0)
    assert zero.status == "fail"
    one_node = check_efa(
        resolve_plan(RunRequest(recipe="qwen3_4b_native")), on_target_host=True, root=sysfs
    )
    assert one_node.status == "skip"


def test_fi_info_endpoints_are_counted():
    listing = "provider: efa\n    fabric: efa\nprovider: efa\n    fabric: efa-direct\n"
    done = subprocess.CompletedProcess([], 0, stdout=listing)
    seen = []
    count = fi_info_endpoints(lambda argv: seen.append(argv) or done, path="/opt/fi_info")
    assert count == 2 and seen == [["/opt/fi_info", "-p", "efa", "-t", "FI_EP_RDM"]]
    failed = subprocess.CompletedProcess([], 1, stdout="")
    assert fi_info_endpoints(lambda argv: failed, path="/opt/fi_info") == 0


def test_the_missing_weights_line_names_the_hub_model_and_the_command(tmp_path):
    plan = resolve_plan(RunRequest(recipe="qwen3_4b_hf"))
    result = check_weights(plan, tmp_path / "absent")
    assert result.status == "fail"
    assert "Qwen/Qwen3-4B-Instruct-2507" in result.detail
    assert "`qwentitan-launch fetch --recipe qwen3_4b_hf`" in result.detail


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face Hub cache holding one snapshot of `repo`, laid out as huggingface_hub
    writes it (blobs, a snapshot of links to them, refs/main naming the commit)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = folder / "blobs" / f"blob-{len(data)}-{abs(hash(name))}"
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root


def fetch(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "qwentitan.launch.launcher.cli", "fetch", *args],
        capture_output=True, text=True, env=env,
    )  # fmt: skip


def test_fetch_puts_the_hub_snapshot_in_the_recipe_folder_offline(tmp_path):
    files = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b"{}",
             "model.safetensors": b"\x00" * 64}  # fmt: skip
    cache = hub_cache(tmp_path / "hub", "Qwen/Qwen3-4B-Instruct-2507", files)
    target = tmp_path / "assets" / "Qwen3-4B-Instruct-2507"

    done = fetch("--recipe", "qwen3_4b_hf", "--dir", str(target), cache=cache)

    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert not any(p.is_symlink() for p in target.iterdir())
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left


def test_fetch_without_the_model_in_an_offline_cache_is_one_sentence(tmp_path):
    target = tmp_path / "model"
    done = fetch("--recipe", "qwen3_moe_kernels", "--dir", str(target), cache=tmp_path / "hub")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "Qwen/Qwen3-30B-A3B" in done.stderr
    assert not target.exists()


@pytest.mark.parametrize(
    ("offline", "mode"), [(False, 0o700), (True, 0o755)], ids=["downloaded", "download fails"]
)
def test_fetch_keeps_the_users_empty_dir(tmp_path, offline, mode):
    files = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b"{}"}
    cache = tmp_path / "hub"
    if not offline:
        hub_cache(cache, "Qwen/Qwen3-4B-Instruct-2507", files)
    target = tmp_path / "mine"
    target.mkdir(mode=mode)
    target.chmod(mode)
    inode = target.stat().st_ino

    done = fetch("--recipe", "qwen3_4b_hf", "--dir", str(target), cache=cache)

    assert "Traceback" not in done.stderr
    assert target.is_dir() and target.stat().st_ino == inode
    assert target.stat().st_mode & 0o777 == mode
    if offline:
        assert done.returncode == 2 and done.stderr.count("\n") == 1
        assert list(target.iterdir()) == []
    else:
        assert done.returncode == 0, done.stderr
        assert {p.name: p.read_bytes() for p in target.iterdir()} == files


@pytest.mark.parametrize("content", [b"", b"notes", b"\x00\xff"])
def test_fetch_dir_naming_a_file_is_one_sentence_and_keeps_it(tmp_path, capsys, content):
    from qwentitan.launch.launcher import cli

    target = tmp_path / "model"
    target.write_bytes(content)
    assert cli.main(["fetch", "--recipe", "qwen3_4b_hf", "--dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"qwentitan-launch fetch: --dir {target} is a file; pass --dir naming a new or empty "
        "folder for the model.\n"
    )
    assert target.read_bytes() == content and sorted(os.listdir(tmp_path)) == ["model"]
