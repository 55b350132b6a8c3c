"""A Platform is the live device module of one process; the Target answers for the machine kind."""

import pytest
import torch

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import get_target
from qwentitan.launch.runtime.peak_flops import peak_flops
from qwentitan.launch.runtime.platforms import (
    CpuDeviceModule,
    get_platform,
    host_device,
    host_target,
)
from qwentitan.launch.runtime.trainer import Trainer


def test_cpu_host_trains_on_gloo_with_sdpa():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert host_device() == host_target() == "cpu"
    platform = get_platform(host_device())
    assert (platform.name, platform.device_type) == ("cpu", "cpu")
    assert isinstance(platform.device_module, CpuDeviceModule)
    target = get_target(host_target())
    assert (target.backend, target.attention, peak_flops(target, 1)) == ("gloo", "sdpa", None)


def test_the_config_names_the_target_not_the_environment(monkeypatch):
    monkeypatch.setenv("QWENTITAN_PLATFORM", "cuda")  # no longer a channel: ignored
    config = Trainer.Config(target="cpu")
    assert config.placed_target().name == "cpu"
    assert Trainer.Config(target="trn2.48xlarge").placed_target().device_type == "neuron"
    with pytest.raises(LaunchError, match=r"^Unknown instance 'tpu'"):
        Trainer.Config(target="tpu")
    with pytest.raises(
        LaunchError, match=r"^Unknown platform 'tpu'; choose one of cpu, cuda, neuron"
    ):
        get_platform("tpu")


def test_the_model_follows_the_target_field():
    from functools import partial

    from qwentitan.launch.recipes.tiny import tiny_model

    build = partial(tiny_model, "tiny-dense", "native")
    flex = Trainer.Config(target="cuda", model_for=build)
    sdpa = Trainer.Config(target="cpu", model_for=build)
    attention = [
        type(c.model_spec.model.layers[0].attention.inner_attention).__qualname__
        for c in (flex, sdpa)
    ]
    assert attention == ["FlexAttention.Config", "ScaledDotProductAttention.Config"]
    assert not flex.training.disable_cuda_graphs and sdpa.training.disable_cuda_graphs


def test_neuron_platform_carries_the_lnc_it_is_given():
    neuron = get_platform("neuron", lnc=2)
    assert (neuron.device_type, neuron.lnc) == ("neuron", 2)
    assert peak_flops(get_target("trn2.48xlarge"), 2) == 158e12  # 79 TFLOPS per core x LNC 2


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


def test_the_model_is_built_once_per_placement(monkeypatch):
    """torchtitan's parser builds the recipe's config, then again with the command line: the
    model is rebuilt only when the command line places it elsewhere."""
    from torchtitan.config import ConfigManager

    from qwentitan.launch.recipes import tiny

    built = []
    real = tiny.model_spec
    monkeypatch.setattr(tiny, "model_spec", lambda *a, **k: built.append(a) or real(*a, **k))
    args = ["--module", "qwentitan.launch.recipes", "--config", "tiny_dense", "--target", "cpu"]
    ConfigManager().parse_args([*args, "--training.steps", "3"])
    assert len(built) == 1  # this host is a CPU host: the recipe's own build stands
    built.clear()
    config = ConfigManager().parse_args([*args[:-1], "cuda"])
    assert len(built) == 2  # placed elsewhere: built for the CPU, then for CUDA
    attention = config.model_spec.model.layers[0].attention.inner_attention
    assert type(attention).__qualname__ == "FlexAttention.Config"


def test_kernel_choices_are_a_config_field_whose_default_is_the_environment(monkeypatch):
    from qwentitan.launch.launcher.plan import load_config
    from qwentitan.modeling.kernel_path import rules_in

    def routes(config) -> set[str]:
        return {rule.name for rule in rules_in(config.model_spec.model)}

    monkeypatch.setenv("QWENTITAN_KERNELS", "experts=reference")
    config = load_config("tiny_moe_kernels", ["--target", "cpu"])
    assert config.kernels == "experts=reference"
    assert routes(config) == {"nki_rope", "reference_experts"}
    monkeypatch.delenv("QWENTITAN_KERNELS")
    chosen = load_config("tiny_moe_kernels", ["--target", "cpu", "--kernels", "attention=nki"])
    assert routes(chosen) == {"nki_rope", "nki_attention", "nki_experts"}
    assert chosen.to_dict()["kernels"] == "attention=nki"  # carried with the config (MLflow)
    with pytest.raises(LaunchError, match=r"kernels='experts=fast' .* choice in nki"):
        load_config("tiny_moe_kernels", ["--target", "cpu", "--kernels", "experts=fast"])
