"""One place chooses the platform; each platform answers for its device, backend and limits."""

import pytest
import torch

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.runtime.platforms import (
    PLATFORM_ENV,
    CpuDeviceModule,
    current_platform,
    get_platform,
)


def test_cpu_host_trains_on_gloo_with_sdpa(monkeypatch):
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU; the CPU choice is tested through the override below")
    platform = current_platform()
    assert (platform.name, platform.device_type, platform.backend) == ("cpu", "cpu", "gloo")
    assert platform.attention == "sdpa" and platform.peak_flops is None
    assert isinstance(platform.device_module, CpuDeviceModule)
    assert not platform.supports_cuda_graphs


def test_the_environment_forces_a_platform(monkeypatch):
    monkeypatch.setenv(PLATFORM_ENV, "cpu")
    assert current_platform().name == "cpu"
    monkeypatch.setenv(PLATFORM_ENV, "tpu")
    with pytest.raises(
        LaunchError, match=r"^Unknown platform 'tpu'; choose one of cpu, cuda, neuron"
    ):
        current_platform()


def test_neuron_platform_follows_the_documented_facts(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = get_platform("neuron")
    assert (neuron.backend, neuron.device_type, neuron.lnc) == ("neuron", "neuron", 2)
    assert neuron.peak_flops == 158e12  # 79 TFLOPS per physical core x LNC 2
    neuron.check_seq_len(2048, 4096)
    with pytest.raises(
        LaunchError, match=r"--seq-len 1000 is not a multiple of 256.*--seq-len 1024"
    ):
        neuron.check_seq_len(1000, 4096)


def test_cpu_memory_is_the_process_rss():
    module = get_platform("cpu").device_module
    module.reset_peak_memory_stats()
    before = module.memory_stats()["reserved_bytes.all.peak"]
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    stats = get_platform("cpu").memory_stats()
    assert stats.kind == "RSS" and stats.capacity_bytes > stats.peak_bytes > 0
    assert stats.peak_bytes >= before + 48 * 2**20
    assert module.current_device() == 0 and module.device_count() == 1
    del block


def test_limits_are_refused_in_one_sentence():
    cpu = get_platform("cpu")
    cpu.check_ranks(cpu.max_ranks)
    with pytest.raises(LaunchError, match=rf"^--ranks {cpu.max_ranks + 1} is more than"):
        cpu.check_ranks(cpu.max_ranks + 1)
    with pytest.raises(LaunchError, match=r"longer than the model's 128 positions"):
        cpu.check_seq_len(129, 128)
