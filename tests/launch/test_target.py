"""One Target per machine kind: train, plan, preflight, the ranks and tracking read one set of facts."""

import ast
from pathlib import Path

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import (
    GIB,
    LNC_ENV,
    TARGETS,
    configured_lnc,
    cpu_cores,
    get_target,
    runtime_lnc,
)
from qwentitan.launch.base.topology import INSTANCES, get_topology
from qwentitan.launch.runtime.platforms import get_platform
from qwentitan.launch.tracking.context import logical_core_config
from qwentitan.launch.tracking.cost import hourly_price

LAUNCH_SRC = Path(__file__).resolve().parents[2] / "packages" / "launch" / "src" / "qwentitan"


def test_cpu_rank_limit_is_one_number_for_train_and_plan():
    limit = cpu_cores()
    # train --ranks: the platform's check; plan/run --ranks-per-node: the topology's
    assert get_platform("cpu").max_ranks == limit == TARGETS["cpu"].max_ranks()
    get_platform("cpu").check_ranks(limit)
    assert get_topology("cpu", ranks_per_node=limit).ranks_per_node == limit
    with pytest.raises(LaunchError, match=rf"^--ranks {limit + 1} is more than this cpu host"):
        get_platform("cpu").check_ranks(limit + 1)
    with pytest.raises(LaunchError, match=rf"^--ranks-per-node {limit + 1} is more than this cpu"):
        get_topology("cpu", ranks_per_node=limit + 1)


def test_lnc_comes_from_one_reader(monkeypatch):
    monkeypatch.delenv(LNC_ENV, raising=False)
    assert configured_lnc() is None and runtime_lnc() == TARGETS["trn2.48xlarge"].default_lnc == 2
    monkeypatch.setenv(LNC_ENV, "1")
    # the ranks' platform and the tracking tag agree with the reader
    assert get_platform("neuron").lnc == runtime_lnc() == 1
    assert logical_core_config("neuron") == "1" and logical_core_config("cpu") == "n/a"
    assert configured_lnc({LNC_ENV: "2"}) == 2  # a plan's or a shell's mapping, same rule
    monkeypatch.setenv(LNC_ENV, "two")
    with pytest.raises(
        LaunchError, match=rf"^{LNC_ENV} is 'two'; set it to 1 or 2, or unset it\.$"
    ):
        runtime_lnc()


def test_only_the_target_module_reads_the_lnc_variable():
    readers = []
    for file in LAUNCH_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and node.value == LNC_ENV:
                readers.append(file.relative_to(LAUNCH_SRC).as_posix())
    assert readers == ["launch/base/target.py"]


def test_sequence_rule_is_the_targets_everywhere(monkeypatch):
    monkeypatch.setenv(LNC_ENV, "2")
    trn2 = TARGETS["trn2.48xlarge"]
    assert trn2.seq_len_multiple(2) == get_topology("trn2.48xlarge").seq_len_multiple == 256
    assert get_platform("neuron").seq_len_multiple == 256
    assert trn2.seq_len_multiple(1) == 128 and TARGETS["cpu"].seq_len_multiple(2) == 1
    rule = r"^--seq-len 1000 is not a multiple of 256, which the Neuron kernels on trn2\.48xlarge"
    with pytest.raises(LaunchError, match=rule + r".*pass --seq-len 1024\.$"):
        trn2.check_seq_len(1000, 2)
    with pytest.raises(LaunchError, match=rule):  # what `train` asks on a Neuron host
        get_platform("neuron").check_seq_len(1000, 4096)


def test_each_kind_derives_ranks_memory_and_flops_from_its_stated_facts():
    trn2 = get_target("trn2.48xlarge")
    assert (trn2.max_ranks(2), trn2.memory_per_rank(2, 64), trn2.peak_flops(2)) == (
        64,
        24 * GIB,
        158e12,
    )
    assert (trn2.max_ranks(1), trn2.memory_per_rank(1, 128), trn2.peak_flops(1)) == (
        128,
        12 * GIB,
        79e12,
    )
    p5 = get_topology("p5.48xlarge")
    assert (p5.device_type, p5.backend, p5.ranks_per_node, p5.memory_per_rank_bytes) == (
        "cuda",
        "nccl",
        8,
        80 * GIB,
    )
    assert TARGETS["cpu"].peak_flops(1) is None
    assert INSTANCES is TARGETS  # the old name is the same table, not a copy


def test_prices_are_the_targets():
    priced = {name: t.price_per_hour for name, t in TARGETS.items() if t.price_per_hour}
    assert set(priced) == {"trn2.48xlarge", "trn1.32xlarge", "p4d.24xlarge", "p5.48xlarge"}
    for name, usd in priced.items():
        assert hourly_price(name)[0] == usd
    assert hourly_price("cpu") is None and hourly_price("cuda") is None
