"""Parameter and FLOP counts: the model cards' figures, the built models, torchtitan's formula."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qwentitan.modeling import (
    FLAVORS,
    ModelingError,
    flavor_to_hf_config,
    flops_per_token,
    native_model_config,
    param_counts,
)

# (total, non-embedding, activated) as printed on the Hugging Face model cards, in billions.
# The number of decimals printed is the rounding the card applied (0.596B is "0.6B", 8.19B is
# "8.2B", 233.85B is "234B": the cards round, never truncate).
CARDS = {
    "qwen3-0.6b": ("0.6", "0.44", None),
    "qwen3-1.7b": ("1.7", "1.4", None),
    "qwen3-4b": ("4.0", "3.6", None),
    "qwen3-8b": ("8.2", "6.95", None),
    "qwen3-14b": ("14.8", "13.2", None),
    "qwen3-32b": ("32.8", "31.2", None),
    "qwen3-30b-a3b": ("30.5", "29.9", "3.3"),
    "qwen3-235b-a22b": ("235", "234", "22"),
}


def _as_card(count: int, card: str) -> str:
    decimals = len(card.partition(".")[2])
    return f"{count / 1e9:.{decimals}f}"


@pytest.mark.parametrize("name", sorted(CARDS))
def test_counts_round_to_the_model_card_figures(name):
    counts = param_counts(name)
    total, non_embedding, active = CARDS[name]
    assert _as_card(counts.total, total) == total
    assert _as_card(counts.non_embedding, non_embedding) == non_embedding
    if active is None:  # dense: every parameter is active
        assert counts.active == counts.total
        assert counts.router == 0
    else:
        assert _as_card(counts.active, active) == active


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights appear once


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_counts_equal_the_built_native_model(name):
    with torch.device("meta"):
        model = native_model_config(name).build()
    assert param_counts(name).total == _numel(model)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "qwen3-0.6b", "qwen3-30b-a3b-4l"])
def test_counts_equal_the_transformers_model(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(flavor_to_hf_config(name))
    counts = param_counts(name)
    assert counts.total == _numel(model)
    embeddings = model.get_input_embeddings().weight.numel()
    if not FLAVORS[name].tie_word_embeddings:
        embeddings += model.get_output_embeddings().weight.numel()
    assert counts.embedding == embeddings


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "qwen3-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("seq_len", [256, 4096])
def test_flops_per_token_equals_torchtitans_own_estimate(name, seq_len):
    config = native_model_config(name)
    with torch.device("meta"):
        model = config.build()
    _, torchtitan_flops = config.get_nparams_and_flops(model, seq_len)
    assert flops_per_token(name, seq_len) == torchtitan_flops


def test_router_is_counted_in_total_and_flops_but_not_in_activated():
    counts = param_counts("qwen3-30b-a3b")
    assert counts.router == 48 * 2048 * 128
    assert counts.total == counts.non_embedding + counts.embedding
    # with the router, 30B-A3B's activated count would print as 3.4B, not the card's 3.3B
    assert _as_card(counts.active + counts.router, "3.3") == "3.4"


def test_flops_grow_with_active_not_total_parameters():
    # 30B-A3B touches ~3B parameters per token: its FLOPs sit near a 3B dense model's, far
    # below 6 x its 30B total.
    f = flops_per_token("qwen3-30b-a3b", 4096)
    assert 6 * param_counts("qwen3-30b-a3b").active_non_embedding < f
    assert f < 6 * param_counts("qwen3-4b").total + 12 * 48 * 32 * 128 * 4096


def test_flops_need_a_positive_sequence_length():
    with pytest.raises(ModelingError, match="positive seq_len"):
        flops_per_token("tiny-dense", 0)
