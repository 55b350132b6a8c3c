"""The launch side of the trn2 path against a fake TorchNeuron that behaves as its public source does.

Nothing here runs on Trainium. `FakeTorchNeuronx` reproduces the behaviour the launcher depends
on, as read in TorchNeuron's Python source (public mirror `parmoham-aws/test-repo-parmoham`):

- `torch_neuronx/distributed/backend.py` (`_set_rt_visible_cores`, `_neuron_runtime_setup`):
  when the neuron process group starts, each process sets `NEURON_RT_VISIBLE_CORES` to its
  `LOCAL_RANK` only if the variable is unset, then asserts the runtime shows it one device;
- `torch_neuronx/memory.py` (`memory_stats`): nested dicts, `stats["allocated_bytes"]["peak"]`,
  `reserved_bytes` always 0 (no cache yet);
- `torch_neuronx/__init__.py` (`get_fallback_ops`): the names of the ops that ran on the CPU.

If TorchNeuron changes one of these, the fake and the code it checks must change together.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import get_topology
from qwentitan.launch.launcher.cli import main
from qwentitan.launch.launcher.environment import lnc_in_compiler_flags, plan_env
from qwentitan.launch.launcher.plan import load_config
from qwentitan.launch.runtime.platforms import get_platform

GIB = 1024**3
TRN2 = ("qwen3_4b_hf", "qwen3_4b_native", "qwen3_moe_kernels")


def _cores(visible: str) -> list[int]:
    """The NeuronCores a NEURON_RT_VISIBLE_CORES value names (`3`, `0-63`, `0,2-3`)."""
    cores: list[int] = []
    for part in visible.split(","):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


class FakeTorchNeuronx(types.ModuleType):
    """`torch_neuronx` as far as the launcher sees it, one process of one rank."""

    def __init__(self, *, fallback: list[str] | None = None, logical_cores: int = 64) -> None:
        super().__init__("torch_neuronx")
        self.logical_cores = logical_cores
        self.fallback = list(fallback or [])
        self.allocated = {
            "current": 3 * GIB,
            "peak": 5 * GIB,
            "allocated": 9 * GIB,
            "freed": 6 * GIB,
        }
        self.runtime_initialised = False
        neuron = types.ModuleType("torch.neuron")
        neuron.is_available = lambda: True
        neuron.device_count = self.device_count
        neuron.current_device = lambda: 0
        neuron.memory_stats = self.memory_stats
        neuron.reset_peak_memory_stats = self.reset_peak_memory_stats
        neuron.get_device_properties = lambda device=None: types.SimpleNamespace(
            name="NeuronCore-v3", total_memory=24 * GIB
        )
        self.neuron = neuron

    # torch_neuronx/distributed/backend.py
    def init_process_group(self, env: dict[str, str]) -> None:
        assert not self.runtime_initialised, "runtime initialised before init_process_group"
        if not env.get("NEURON_RT_VISIBLE_CORES"):
            env["NEURON_RT_VISIBLE_CORES"] = env["LOCAL_RANK"]
        self.runtime_initialised = True
        self.visible = _cores(env["NEURON_RT_VISIBLE_CORES"])
        self.local_world_size = int(env["LOCAL_WORLD_SIZE"])
        assert self._vnc_count() == 1, (
            "Attempted to have more than one device per process in distributed setup"
        )

    # torch_neuronx/csrc/core/NeuronDevice.cpp: the cores this process sees (vnc_count) differ
    # from device_count, which is the local world size once the process group set it.
    def _vnc_count(self) -> int:
        return len(self.visible) if self.runtime_initialised else self.logical_cores

    def device_count(self) -> int:
        return self.local_world_size if self.runtime_initialised else self._vnc_count()

    # torch_neuronx/memory.py
    def memory_stats(self, device=None) -> dict[str, object]:
        zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        return {
            "allocated_bytes": dict(self.allocated),
            "reserved_bytes": zero,
            "active_bytes": dict(self.allocated),
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_tensor_frees": 7,
            "allocation_requests": 11,
        }

    def reset_peak_memory_stats(self, device=None) -> None:
        self.allocated["peak"] = self.allocated["current"]

    # torch_neuronx/__init__.py
    def get_fallback_ops(self) -> list[str]:
        return list(self.fallback)


@pytest.fixture
def neuron(monkeypatch):
    """Install a fake TorchNeuron: `import torch_neuronx` and `torch.neuron` both find it."""

    def install(**kwargs) -> FakeTorchNeuronx:
        fake = FakeTorchNeuronx(**kwargs)
        monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
        monkeypatch.setattr(torch, "neuron", fake.neuron, raising=False)
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
        return fake

    return install


# finding 1: one visible NeuronCore per rank


@pytest.mark.parametrize("local_rank", [0, 1, 63])
def test_every_rank_of_a_trn2_node_starts_its_process_group(neuron, local_rank):
    env, _ = plan_env(get_topology("trn2.48xlarge"), nodes=1, shell={}, compile_cache="/tmp/neff")
    env.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="64")
    fake = neuron()
    fake.init_process_group(env)
    assert env["NEURON_RT_VISIBLE_CORES"] == str(local_rank)
    assert fake._vnc_count() == 1 and fake.device_count() == 64, "device_count: local world size"


@pytest.mark.parametrize("recipe", TRN2)
def test_trn2_plans_name_no_core_range(recipe, capsys):
    assert main(["plan", "--recipe", recipe, "--json"]) == 0
    env = json.loads(capsys.readouterr().out)["env"]
    assert len(_cores(env.get("NEURON_RT_VISIBLE_CORES", "0"))) == 1


def test_a_core_range_in_the_shell_is_refused_in_one_sentence():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan

    with pytest.raises(LaunchError, match=r"^NEURON_RT_VISIBLE_CORES=0-63 .* unset it"):
        resolve_plan(
            RunRequest(recipe="qwen3_4b_native"), shell={"NEURON_RT_VISIBLE_CORES": "0-63"}
        )
    # One core is what a user pins on purpose for a one-rank run; it is passed through.
    one = resolve_plan(
        RunRequest(recipe="tiny_dense", instance="trn2.48xlarge", ranks_per_node=1, seq_len=512),
        shell={"NEURON_RT_VISIBLE_CORES": "5"},
    )
    assert one.rank_env({"NEURON_RT_VISIBLE_CORES": "5"})["NEURON_RT_VISIBLE_CORES"] == "5"
    assert "NEURON_RT_VISIBLE_CORES" not in one.rank_env({})


# finding 5: TorchNeuron's nested memory_stats


def test_neuron_memory_reads_the_nested_allocator_statistics(neuron, monkeypatch, tmp_path):
    from qwentitan.launch.runtime import neuron_runtime

    neuron()
    stats = get_platform("neuron").memory_stats()
    assert (stats.current_bytes, stats.peak_bytes) == (3 * GIB, 5 * GIB)
    assert stats.capacity_bytes == 24 * GIB and stats.kind == "HBM"
    # The rank's own core (set by TorchNeuron from LOCAL_RANK) gives the sysfs figure too.
    folder = tmp_path / "neuron0/neuron_core2/stats/memory_usage/device_mem"
    folder.mkdir(parents=True)
    (folder / "peak").write_text(str(8 * GIB))
    monkeypatch.setattr(neuron_runtime, "SYSFS_ROOT", tmp_path)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1")
    # logical core 1 at the plan's LNC 2 is physical cores 2 and 3
    assert get_platform("neuron", lnc=2).memory_stats().device_peak_bytes == 8 * GIB


def test_torchtitans_memory_monitor_reads_the_neuron_peak(neuron, monkeypatch):
    """torchtitan's DeviceMemoryMonitor reads flat CUDA keys: the platform's module supplies them."""
    from torchtitan.components import metrics

    neuron()
    module = get_platform("neuron").device_module
    monkeypatch.setattr(metrics, "device_module", module)
    monitor = object.__new__(metrics.DeviceMemoryMonitor)
    monitor.device, monitor.device_capacity = "neuron:0", 24 * GIB
    peak = monitor.get_peak_stats()
    # What NRT handed the allocator is what CUDA calls reserved; TorchNeuron caches nothing.
    assert peak.max_active_gib == 5.0 and peak.max_reserved_gib == 5.0
    assert (peak.num_alloc_retries, peak.num_ooms) == (0, 0)
    assert module.device_count() == 64  # everything else is TorchNeuron's own module


_NESTED = {
    "allocated_bytes": {"current": 3 * GIB, "peak": 5 * GIB},
    "reserved_bytes": {"current": 0, "peak": 0},
    "active_bytes": {"current": 3 * GIB, "peak": 5 * GIB},
    "num_alloc_retries": 0,
    "num_ooms": 0,
}
# torch.cuda's flat shape, which a torch-neuronx whose torch.accelerator memory functions work
# (2.34.0 release notes) may give instead; reserved already includes allocated there.
_FLAT = {
    "allocated_bytes.all.current": 3 * GIB,
    "allocated_bytes.all.peak": 5 * GIB,
    "active_bytes.all.peak": 5 * GIB,
    "reserved_bytes.all.current": 4 * GIB,
    "reserved_bytes.all.peak": 6 * GIB,
    "num_alloc_retries": 0,
    "num_ooms": 0,
}


@pytest.mark.parametrize(
    ("shape", "want"), [(_NESTED, (5 * GIB, 5 * GIB)), (_FLAT, (5 * GIB, 6 * GIB))]
)
def test_memory_figures_are_read_from_the_nested_and_the_flat_shape(shape, want):
    from qwentitan.launch.runtime.neuron_runtime import flat_memory_stats

    flat = flat_memory_stats(shape)
    assert (flat["active_bytes.all.peak"], flat["reserved_bytes.all.peak"]) == want
    assert (flat["num_alloc_retries"], flat["num_ooms"]) == (0, 0)


def test_an_unknown_memory_shape_is_unknown_on_the_console_and_absent_from_mlflow(
    neuron, monkeypatch, caplog
):
    from torchtitan.components import metrics

    from qwentitan.launch.tracking.summary import step_values

    fake = neuron()
    fake.neuron.memory_stats = lambda device=None: {"bytes_in_use": 5 * GIB}  # a shape not known
    module = get_platform("neuron").device_module
    monkeypatch.setattr(metrics, "device_module", module)
    monitor = object.__new__(metrics.DeviceMemoryMonitor)
    monitor.device, monitor.device_capacity = "neuron:0", 24 * GIB
    peak = monitor.get_peak_stats()
    line = f"memory: {peak.max_reserved_gib:5.2f}GiB({peak.max_reserved_pct:.2f}%)"
    assert line == "memory: unknownGiB(unknown%)", "torchtitan's console line"
    logged = step_values({"memory/max_reserved(GiB)": peak.max_reserved_gib, "loss": 1.0}, 1)
    assert not any(key.startswith("memory") for key in logged), logged
    assert get_platform("neuron").memory_stats().peak_bytes == -1, "never 0"


def test_the_per_core_peak_is_read_from_sysfs(tmp_path):
    from qwentitan.launch.runtime.neuron_runtime import sysfs_peak_bytes

    # Logical core 5 at LNC 2 is physical cores 10 and 11: chip 1, cores 2 and 3.
    for core, peak in ((2, 7 * GIB), (3, 6 * GIB)):
        folder = tmp_path / "neuron1" / f"neuron_core{core}/stats/memory_usage/device_mem"
        folder.mkdir(parents=True)
        (folder / "peak").write_text(f"{peak}\n")
    assert sysfs_peak_bytes(5, lnc=2, root=tmp_path) == 7 * GIB
    assert sysfs_peak_bytes(6, lnc=2, root=tmp_path) is None  # not readable: no figure


# finding 6: silent CPU fallbacks


class _Tags:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def test_fallback_ops_are_tagged_and_warned(neuron, caplog):
    from qwentitan.launch.runtime.neuron_runtime import report_fallback_ops

    neuron(fallback=["aten::_foreach_sqrt", "aten::nonzero"])
    run = _Tags()
    with caplog.at_level(logging.WARNING):
        ops = report_fallback_ops(run)
    assert ops == ["aten::_foreach_sqrt", "aten::nonzero"]
    assert run.tags == {
        "neuron.fallback_ops": "aten::_foreach_sqrt,aten::nonzero",
        "neuron.fallback_op_count": "2",
    }
    assert "2 ops ran on the CPU" in caplog.text and "aten::nonzero" in caplog.text


def test_no_fallback_is_tagged_as_none(neuron, caplog):
    from qwentitan.launch.runtime.neuron_runtime import report_fallback_ops

    neuron()
    run = _Tags()
    with caplog.at_level(logging.WARNING):
        assert report_fallback_ops(run) == []
    assert run.tags == {"neuron.fallback_ops": "none", "neuron.fallback_op_count": "0"}
    assert "CPU" not in caplog.text


def test_without_torchneuron_there_is_no_fallback_list(monkeypatch):
    from qwentitan.launch.runtime.neuron_runtime import fallback_ops

    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import fails
    assert fallback_ops() is None


# finding 9: the compiler's -lnc spelling


@pytest.mark.parametrize(
    ("flags", "lnc"),
    [("-lnc 1", 1), ("-O1 -lnc=1", 1), ("--lnc 2", 2), ("--logical-nc-config=1", 1), ("-O1", None)],
)
def test_every_spelling_of_the_compiler_lnc_is_read(flags, lnc):
    assert lnc_in_compiler_flags(flags) == lnc


def test_a_conflicting_short_lnc_flag_is_refused():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan

    with pytest.raises(LaunchError, match="NEURON_CC_FLAGS sets --lnc=1"):
        resolve_plan(RunRequest(recipe="qwen3_4b_native"), shell={"NEURON_CC_FLAGS": "-O1 -lnc 1"})


# finding 10 (and 6 in preflight): the one-step compile smoke


def _smoke_runner(seconds: float, fallback: list[str] | None):
    """Stands for `qwentitan-launch train --steps 1`: writes what the Trainer writes after step 1."""
    calls: list[list[str]] = []

    def run(command: list[str], env: dict[str, str]) -> int:
        calls.append(command)
        run.envs.append(env)
        folder = Path(command[command.index("--dump-folder") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        report = {"step": 1, "seconds": seconds, "fallback_ops": fallback}
        (folder / "reports").mkdir(parents=True, exist_ok=True)
        (folder / "reports" / "first_step.json").write_text(json.dumps(report))
        return 0

    run.calls = calls
    run.envs = []
    return run


def test_compile_smoke_reports_the_first_step_time(monkeypatch):
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    monkeypatch.delenv("QWENTITAN_MLFLOW", raising=False)  # MLflow on by default
    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1))
    runner = _smoke_runner(312.5, None)
    result = checks.check_compile_smoke(plan, runner=runner)
    assert result.status == "pass" and result.figures["first_step_s"] == 312.5
    assert "312.5 s" in result.detail
    # The command is the plan's own torchrun line, which torchtitan parses to one step, no saves.
    command = runner.calls[0]
    overrides = command[command.index("--config") + 2 :]
    config = load_config("tiny_dense", overrides)
    assert config.training.steps == 1 and not config.checkpoint.enable
    assert config.dump_folder == command[command.index("--dump-folder") + 1]
    # MLflow is off through the config, not through an environment variable set here
    assert not config.metrics.mlflow.enable and "QWENTITAN_MLFLOW" not in runner.envs[0]


def test_compile_smoke_fails_a_step_that_falls_back_unless_allowed(monkeypatch):
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1))
    runner = _smoke_runner(5.0, ["aten::nonzero"])
    failed = checks.check_compile_smoke(plan, runner=runner)
    assert failed.status == "fail" and "aten::nonzero" in failed.detail
    assert "--allow-fallback" in failed.detail
    allowed = checks.check_compile_smoke(plan, runner=runner, allow_fallback=True)
    assert allowed.status == "pass" and allowed.figures["fallback_ops"] == ["aten::nonzero"]


def test_compile_smoke_fails_when_the_step_fails():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1))
    result = checks.check_compile_smoke(plan, runner=lambda command, env: 1)
    assert result.status == "fail" and "exit code 1" in result.detail


def test_compile_smoke_is_skipped_off_the_target_host():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    def never(command, env):
        raise AssertionError("no step may run on a host that is not the target")

    result = checks.check_compile_smoke(
        resolve_plan(RunRequest(recipe="qwen3_4b_native")), runner=never
    )
    assert result.status == "skip" and "neuron" in result.detail


def test_fallback_tags_reach_the_mlflow_run(neuron, tmp_path, new_mlflow_store):
    from mlflow import MlflowClient

    from qwentitan.launch.runtime.neuron_runtime import report_fallback_ops
    from qwentitan.launch.tracking import MLflowLogger

    uri = new_mlflow_store(tmp_path)
    run = MLflowLogger.Config(tracking_uri=uri, recipe="tiny_dense", path="native").build(
        run_dir=tmp_path / "run", config_dict={}, tags={"platform": "neuron"}, world_size=1
    )
    neuron(fallback=["aten::nonzero"])
    report_fallback_ops(run)
    run.close()
    tags = MlflowClient(uri).get_run(run.writer.run_id).data.tags
    assert tags["neuron.fallback_ops"] == "aten::nonzero"
    assert tags["neuron.fallback_op_count"] == "1" and tags["platform"] == "neuron"


@pytest.mark.slow
def test_compile_smoke_trains_one_real_step_on_this_cpu_host():
    """The whole route once: torchrun, our Trainer timing step 1 and writing its report."""
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    plan = resolve_plan(
        RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1, seq_len=64)
    )
    result = checks.check_compile_smoke(plan)
    assert result.status == "pass", result.detail
    assert 0 < result.figures["first_step_s"] <= result.figures["wall_s"]
    assert result.figures["fallback_ops"] is None  # no TorchNeuron on CPU: no list, not []


@pytest.mark.neuron
def test_the_real_torchneuron_still_has_the_faked_shapes():
    """On a Trainium host: the installed TorchNeuron against what the fake above assumes."""
    real = pytest.importorskip("torch_neuronx")
    stats = real.memory_stats(0)
    assert isinstance(stats["allocated_bytes"], dict) and "peak" in stats["allocated_bytes"]
    assert isinstance(real.get_fallback_ops(), (list, set, tuple))
    assert get_platform("neuron").memory_stats().peak_bytes >= 0


# finding 2, launch side: the platform choice must not depend on PyTorch's backend autoload


def test_an_installed_torchneuron_is_found_with_autoload_off(tmp_path, monkeypatch):
    """With TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imports torch_neuronx, so torch.neuron is
    missing until someone does; the platform layer must, or a trn2 host trains on its CPU."""
    from qwentitan.launch.runtime.platforms import get_platform, host_device

    package = tmp_path / "torch_neuronx"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import types\nimport torch\n"
        "torch.neuron = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 64)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch, "neuron", None, raising=False)  # undone: torch.neuron removed
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # undone: the import forgotten
    monkeypatch.delitem(sys.modules, "torch_neuronx")
    assert host_device() == "neuron"
    assert get_platform("neuron").max_ranks == 64


def test_preflight_cli_adds_the_smoke_on_request_and_refuses_a_core_range(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-63")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    assert main(["preflight", "--recipe", "qwen3_4b_native", "--json"]) == 2
    assert "NEURON_RT_VISIBLE_CORES=0-63 is set" in capsys.readouterr().err
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    main(["preflight", "--recipe", "qwen3_4b_native", "--compile-smoke", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["compile_smoke"]["status"] == "skip"  # this host is no trn2
    assert checks["lnc"]["status"] == "pass"
    main(["preflight", "--recipe", "qwen3_4b_native", "--json"])
    assert "compile_smoke" not in {c["name"] for c in json.loads(capsys.readouterr().out)["checks"]}


# issue 22: preflight's kernels check on a Neuron host


@pytest.mark.parametrize(
    ("version", "wrap_nki", "route"), [("2.14.3.0", False, "nki.jit"), ("0.1.0", True, "wrap_nki")]
)
def test_the_kernels_check_launches_on_the_neuron_device_and_names_the_route(
    neuron, monkeypatch, version, wrap_nki, route
):
    """No neuron tensors exist here: the ops' numbers come from this CPU, while the device the
    check asks for and the route it names are what a Neuron host with this torch-neuronx gets."""
    from qwentitan.kernels import numerics
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.preflight import checks

    plan = resolve_plan(RunRequest(recipe="qwen3_moe_kernels"))
    fake = neuron()
    fake.__version__ = version  # the release SDK 2.33 documents, or the April 2026 source
    if wrap_nki:
        fake.wrap_nki = lambda kernel: kernel
    monkeypatch.setattr(checks, "host_device_type", lambda: "neuron")
    asked: list[tuple[str, str, bool]] = []
    real = numerics.numerics_report

    def on_this_cpu(op, device, dtype, *, use_nki):
        asked.append((op, str(device), use_nki))
        return real(op, "cpu", dtype, use_nki=use_nki)

    monkeypatch.setattr(numerics, "numerics_report", on_this_cpu)
    result = checks.check_kernels(plan)
    assert asked == [("rope", "neuron", True), ("grouped_experts", "neuron", True)]
    assert result.status == "pass" and "on neuron" in result.detail
    assert result.detail.startswith(f"rope {route} 0.00e+00, grouped_experts {route} ")
    assert {f["route"] for f in result.figures.values()} == {route}


# issue 29: one probe of the host for `plan` and `train`


def test_plan_and_train_pick_the_same_instance_on_a_trn2_host(
    neuron, monkeypatch, tmp_path, capsys
):
    """A recipe that names no instance plans for this host's Target, by the probe `train` and
    every rank use: on a Neuron host a trn2.48xlarge (plan used to pick the CPU)."""
    import json

    from qwentitan.launch.launcher import cli, supervisor
    from qwentitan.launch.launcher.plan import default_instance
    from qwentitan.launch.runtime.platforms import host_target

    neuron()
    assert default_instance("tiny_dense") == host_target() == "trn2.48xlarge"
    launched = []
    monkeypatch.setattr(supervisor, "supervise", lambda argv, env, **_: launched.append(argv) or 0)
    run_dir = str(tmp_path.resolve() / "run")
    size = ["--recipe", "tiny_dense", "--seq-len", "512", "--run-dir", run_dir]
    assert cli.main(["plan", *size, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["topology"]["instance"] == "trn2.48xlarge" and planned["world_size"] == 64
    assert cli.main(["train", *size]) == 0
    (train_argv,) = launched
    assert train_argv[3:] == planned["torchrun"][1:]  # the very line, trn2 placement included
    assert (
        "--target" in train_argv and train_argv[train_argv.index("--target") + 1] == "trn2.48xlarge"
    )
