"""The init functions a model config runs, and the refusal of those TorchNeuron mishandles."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
from torch import nn

from qwentitan.modeling import ModelingError, check_neuron_init, native_model_config, param_init_ops


@pytest.mark.parametrize("flavor", ["tiny-dense", "tiny-moe", "qwen3-30b-a3b-4l"])
def test_torchtitans_qwen3_initialises_without_trunc_normal(flavor):
    config = native_model_config(flavor)
    ops = param_init_ops(config)
    # The fused wqkv init is a closure around the base init: it is looked into, not skipped.
    assert ops["layers.0.attention.qkv_linear.wqkv.param_init.weight"] == ["normal_"]
    assert not any("trunc_normal_" in names for names in ops.values())
    check_neuron_init(config)


def test_a_config_with_trunc_normal_is_refused_naming_the_path_and_the_fix():
    config = native_model_config("tiny-dense")
    lm_head = dataclasses.replace(
        config.lm_head, param_init={"weight": partial(nn.init.trunc_normal_, std=0.02)}
    )
    config = dataclasses.replace(config, lm_head=lm_head)
    with pytest.raises(ModelingError, match=r"lm_head\.param_init\.weight.*use nn\.init\.normal_"):
        check_neuron_init(config)
