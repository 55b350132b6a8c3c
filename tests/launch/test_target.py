"""One Target per machine kind: train, plan, preflight, the ranks and tracking read one set of facts."""

import ast
from pathlib import Path

import pytest

from qwentitan.launch.base.env_defaults import LNC_ENV, configured_lnc
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import (
    GIB,
    TARGETS,
    cpu_cores,
    get_target,
    get_topology,
)
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.runtime.peak_flops import peak_flops
from qwentitan.launch.runtime.platforms import get_platform
from qwentitan.launch.tracking.summary import hourly_price

LAUNCH_SRC = Path(__file__).resolve().parents[2] / "packages" / "launch" / "src" / "qwentitan"


def test_the_cpu_host_takes_more_ranks_than_cores_with_a_note():
    limit = cpu_cores()
    # train, plan and the pilot: one Target check, one number
    assert get_platform("cpu").max_ranks == limit == TARGETS["cpu"].max_ranks()
    assert get_topology("cpu", ranks_per_node=limit).note is None
    crowded = get_topology("cpu", ranks_per_node=limit + 2)
    assert crowded.ranks_per_node == limit + 2
    assert crowded.note.startswith(f"{limit + 2} ranks share this host's {limit} CPU cores")
    # an accelerator is not shared: more ranks than it holds is refused, naming the field
    with pytest.raises(LaunchError, match=r"^ranks_per_node 65 is more than trn2") as info:
        get_topology("trn2.48xlarge", ranks_per_node=65)
    assert info.value.field == "ranks_per_node"
    assert info.value.phrased(lambda field: "--ranks").startswith("--ranks 65 is more")


def test_lnc_variable_has_one_reader_and_is_honoured_unless_a_flag_says_else():
    assert configured_lnc({}) is None
    assert configured_lnc({LNC_ENV: "2"}) == 2  # a plan's or a shell's mapping, same rule
    with pytest.raises(
        LaunchError, match=rf"^{LNC_ENV} is 'two'; set it to 1 or 2, or unset it\.$"
    ):
        configured_lnc({LNC_ENV: "two"})
    exported = resolve_plan(
        RunRequest(recipe="qwen3_4b_native", instance="trn2.48xlarge", ranks_per_node=64),
        shell={LNC_ENV: "1"},
    )
    assert exported.lnc == 1 and exported.env_sources[LNC_ENV] == "environment"
    flagged = resolve_plan(
        RunRequest(recipe="qwen3_4b_native", instance="trn2.48xlarge", lnc=2), shell={LNC_ENV: "1"}
    )
    assert flagged.lnc == 2 and flagged.env[LNC_ENV] == "2"
    assert flagged.env_sources[LNC_ENV] == "flag"


def test_only_env_defaults_reads_the_environment():
    """qwentitan.launch reads environment variables in one module, which writes none, and
    writes its own environment in one other, for one block at a time (`scoped_env`)."""
    readers = set()
    for file in LAUNCH_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                readers.add(file.relative_to(LAUNCH_SRC).as_posix())
            if isinstance(node, ast.Constant) and node.value == LNC_ENV:
                readers.add(file.relative_to(LAUNCH_SRC).as_posix())
    assert readers == {"launch/base/env_defaults.py", "launch/base/scoped_env.py"}
    reader = (LAUNCH_SRC / "launch/base/env_defaults.py").read_text()
    for write in ("os.environ[", "environ.update", "environ.pop", "environ.setdefault"):
        assert write not in reader, write


def test_sequence_rule_is_the_targets_everywhere():
    trn2 = TARGETS["trn2.48xlarge"]
    # NKI flash attention on Neuron takes multiples of 512, at either LNC
    assert trn2.seq_len_multiple(2) == get_topology("trn2.48xlarge").seq_len_multiple == 512
    assert trn2.seq_len_multiple(1) == 512 and TARGETS["cpu"].seq_len_multiple(2) == 1
    rule = r"^seq_len 1000 is not a multiple of 512, which the NKI attention kernels on "
    with pytest.raises(LaunchError, match=rule + r"trn2\.48xlarge need; pass seq_len 1024\.$"):
        trn2.check_seq_len(1000, 2)
    with pytest.raises(LaunchError, match=r"^seq_len 768 is not a multiple of 512"):
        resolve_plan(RunRequest(recipe="qwen3_4b_native", instance="trn2.48xlarge", seq_len=768))


def test_each_kind_derives_ranks_memory_and_flops_from_its_stated_facts():
    trn2 = get_target("trn2.48xlarge")
    assert (trn2.max_ranks(2), trn2.memory_per_rank(2, 64), peak_flops(trn2, 2)) == (
        64,
        24 * GIB,
        158e12,
    )
    assert (trn2.max_ranks(1), trn2.memory_per_rank(1, 128), peak_flops(trn2, 1)) == (
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
    assert peak_flops(TARGETS["cpu"], 1) is None


def test_prices_are_the_targets():
    priced = {name: t.price_per_hour for name, t in TARGETS.items() if t.price_per_hour}
    assert set(priced) == {"trn2.48xlarge", "p4d.24xlarge", "p5.48xlarge"}
    for name, usd in priced.items():
        assert hourly_price(name)[0] == usd
    assert hourly_price("cpu") is None and hourly_price("cuda") is None
