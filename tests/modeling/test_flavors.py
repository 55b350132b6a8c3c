import pytest

from qwentitan.modeling import FLAVORS, Flavor, ModelingError, get_flavor

PUBLISHED = [
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
]


def test_table_holds_every_flavor_the_recipes_name():
    assert set(FLAVORS) == {
        *PUBLISHED,
        "qwen3-30b-a3b-4l",
        "tiny-dense",
        "tiny-dense-untied",
        "tiny-moe",
    }
    assert all(FLAVORS[n].hf_repo for n in PUBLISHED)


def test_unknown_flavor_names_the_valid_ones():
    with pytest.raises(ModelingError, match=r"Unknown Qwen3 flavor 'qwen3-7b'.*qwen3-8b.*tiny-moe"):
        get_flavor("qwen3-7b")


def test_get_flavor_passes_a_flavor_through():
    f = FLAVORS["tiny-dense"].replace(name="mine", num_hidden_layers=3)
    assert get_flavor(f) is f


def test_reduced_moe_is_30b_a3b_cut_to_4_layers_64_experts_top4():
    full, reduced = get_flavor("qwen3-30b-a3b"), get_flavor("qwen3-30b-a3b-4l")
    assert (reduced.num_hidden_layers, reduced.num_experts, reduced.num_experts_per_tok) == (
        4,
        64,
        4,
    )
    same = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert all(getattr(full, k) == getattr(reduced, k) for k in (*same, "moe_intermediate_size"))


def test_tiny_flavors_keep_the_qwen3_architecture_and_vocabulary():
    dense, moe = get_flavor("tiny-dense"), get_flavor("tiny-moe")
    for f in (dense, moe):
        assert f.vocab_size == 151936
        assert f.num_attention_heads > f.num_key_value_heads  # GQA
    assert dense.tie_word_embeddings and not dense.is_moe
    assert moe.is_moe and (moe.num_experts, moe.num_experts_per_tok) == (8, 2)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(num_key_value_heads=3), "not a multiple"),
        (dict(num_experts=8, num_experts_per_tok=9, moe_intermediate_size=8), "top-k"),
        (dict(num_experts=8, num_experts_per_tok=2), "moe_intermediate_size"),
    ],
)
def test_inconsistent_flavor_is_refused(changes, match):
    with pytest.raises(ModelingError, match=match):
        Flavor(
            name="bad",
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
        ).replace(**changes)
