"""The replacement registry on plain dataclass trees (no torchtitan)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest

from qwentitan.kernels import KernelError, ReplacementRule, apply_replacements, config_paths


@dataclasses.dataclass(kw_only=True)
class Rope:
    dim: int


@dataclasses.dataclass(kw_only=True)
class FastRope(Rope):
    pass


@dataclasses.dataclass(kw_only=True, slots=True)
class Attention:
    rope: Rope
    heads: int = 4


@dataclasses.dataclass(kw_only=True, slots=True)
class Layer:
    attention: Attention


@dataclasses.dataclass(kw_only=True, slots=True)
class Model:
    layers: list
    extras: dict = dataclasses.field(default_factory=dict)


def _model(n=4):
    return Model(layers=[Layer(attention=Attention(rope=Rope(dim=8))) for _ in range(n)])


def _fast(rope):
    return FastRope(dim=rope.dim)


def test_every_matching_module_is_replaced_and_logged(caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger="qwentitan.kernels"):
        new = apply_replacements(model, [ReplacementRule("layers.*.attention.rope", _fast, "fast")])
    assert all(isinstance(layer.attention.rope, FastRope) for layer in new.layers)
    assert [r.getMessage() for r in caplog.records] == [
        f"fast  layers.{i}.attention.rope" for i in range(4)
    ]


def test_the_input_config_is_never_modified():
    model = _model()
    before = copy.deepcopy(model)
    new = apply_replacements(model, [ReplacementRule("layers.*.attention.rope", _fast, "fast")])
    assert model == before and not any(isinstance(x.attention.rope, FastRope) for x in model.layers)
    assert new is not model and new.layers is not model.layers
    assert new.extras is model.extras  # untouched branches are shared, not copied


def test_a_narrower_pattern_selects_some_layers_only():
    new = apply_replacements(
        _model(), [ReplacementRule("layers.[0-1].attention.rope", _fast, "fast")]
    )
    assert [type(layer.attention.rope) for layer in new.layers] == [FastRope, FastRope, Rope, Rope]
    only_3 = apply_replacements(_model(), [ReplacementRule("layers.3.attention.rope", _fast, "f")])
    assert [type(x.attention.rope) for x in only_3.layers] == [Rope, Rope, Rope, FastRope]


def test_a_pattern_matching_nothing_is_an_error():
    with pytest.raises(KernelError, match=r"'layers\.\*\.attn\.rope' matches no module"):
        apply_replacements(_model(), [ReplacementRule("layers.*.attn.rope", _fast, "fast")])


def test_rules_apply_in_order_and_reach_dict_entries_and_tuples():
    model = Model(layers=(Layer(attention=Attention(rope=Rope(dim=2))),), extras={"r": Rope(dim=3)})
    new = apply_replacements(
        model,
        [
            ReplacementRule("layers.0.attention", lambda a: dataclasses.replace(a, heads=8), "h"),
            ReplacementRule("layers.0.attention.rope", _fast, "fast"),
            ReplacementRule("extras.r", _fast, "fast"),
        ],
    )
    assert isinstance(new.layers, tuple) and new.layers[0].attention.heads == 8
    assert isinstance(new.layers[0].attention.rope, FastRope)
    assert isinstance(new.extras["r"], FastRope) and type(model.extras["r"]) is Rope


def test_config_paths_lists_addressable_paths():
    paths = config_paths(_model(n=1))
    assert "layers.0.attention.rope" in paths and "layers.0.attention.rope.dim" in paths
