"""The instance catalogue: ranks and memory per rank from the documented trn2 figures."""

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB, TARGETS, get_topology


def test_trn2_lnc2_is_64_ranks_of_24_gib():
    t = get_topology("trn2.48xlarge")
    assert (t.lnc, t.ranks_per_node, t.device_type, t.backend) == (2, 64, "neuron", "neuron")
    assert t.memory_per_rank_bytes == 24 * GIB
    assert t.target.physical_cores == 128
    assert t.seq_len_multiple == 512


def test_trn2_lnc1_is_128_ranks_of_12_gib():
    t = get_topology("trn2.48xlarge", lnc=1)
    assert (t.ranks_per_node, t.memory_per_rank_bytes, t.seq_len_multiple) == (128, 12 * GIB, 512)


def test_trn1_is_refused_as_torchneuron_supports_trn2_and_trn3_only():
    with pytest.raises(LaunchError, match=r"'trn1\.32xlarge' is not supported: TorchNeuron"):
        get_topology("trn1.32xlarge")


@pytest.mark.parametrize("lnc", [0, 3, 4])
def test_odd_or_unsupported_lnc_is_refused(lnc):
    with pytest.raises(LaunchError, match=rf"LNC {lnc} is not valid.*pass lnc 2"):
        get_topology("trn2.48xlarge", lnc=lnc)


def test_unknown_instance_is_one_sentence_naming_the_choices():
    with pytest.raises(LaunchError) as info:
        get_topology("g5.xlarge")
    message = str(info.value)
    assert message.count(".") >= 1 and "\n" not in message
    assert all(name in message for name in TARGETS)


def test_cpu_host_defaults_to_two_ranks_sharing_memory():
    t = get_topology("cpu")
    assert (t.device_type, t.backend, t.ranks_per_node, t.seq_len_multiple) == ("cpu", "gloo", 2, 1)
    assert t.memory_per_rank_bytes > 0


def test_lnc_on_a_non_neuron_instance_is_refused():
    with pytest.raises(LaunchError, match="Trainium only"):
        get_topology("cpu", lnc=2)


def test_too_many_ranks_per_node_is_refused():
    with pytest.raises(
        LaunchError,
        match=r"^ranks_per_node 65 is more than trn2\.48xlarge holds \(64 logical cores at LNC 2\); pass ranks_per_node 64 or fewer\.$",
    ):
        get_topology("trn2.48xlarge", ranks_per_node=65)
