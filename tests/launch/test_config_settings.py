"""One recipe registry, and settings as Config fields: the environment only gives defaults,
torchtitan's own overrides (`--metrics.mlflow.FIELD`, `--hf_assets_path`) replace them."""

from __future__ import annotations

import pytest

from qwentitan.launch import recipes
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import cli, plan
from qwentitan.launch.launcher.pilot import PAIRS
from qwentitan.launch.launcher.plan import load_config

SETTINGS_ENV = {
    "QWENTITAN_MLFLOW": "on",
    "MLFLOW_TRACKING_URI": "sqlite:////env/mlflow.db",
    "QWENTITAN_MLFLOW_EXPERIMENT": "env-experiment",
    "QWENTITAN_MLFLOW_RUN_NAME": "env-run",
    "QWENTITAN_MLFLOW_PARENT_RUN_ID": "env-parent",
    "QWENTITAN_PRICE_PER_HOUR": "12.5",
    "QWENTITAN_INSTANCE_TYPE": "trn2.48xlarge",
}


def mlflow_fields(config) -> dict[str, object]:
    mlflow = config.metrics.mlflow
    names = ("enable", "tracking_uri", "experiment", "run_name", "parent_run_id", "price_per_hour",
             "instance_type")  # fmt: skip
    return {name: getattr(mlflow, name) for name in names}


def test_environment_gives_the_defaults_and_torchtitan_overrides_win(monkeypatch):
    for name, value in SETTINGS_ENV.items():
        monkeypatch.setenv(name, value)
    assert mlflow_fields(load_config("tiny_dense", [])) == {
        "enable": True,
        "tracking_uri": "sqlite:////env/mlflow.db",
        "experiment": "env-experiment",
        "run_name": "env-run",
        "parent_run_id": "env-parent",
        "price_per_hour": 12.5,
        "instance_type": "trn2.48xlarge",
    }
    overridden = load_config(
        "tiny_dense",
        ["--metrics.mlflow.no-enable", "--metrics.mlflow.tracking_uri", "sqlite:////flag.db",
         "--metrics.mlflow.experiment", "flag-experiment", "--metrics.mlflow.run_name", "r",
         "--metrics.mlflow.parent_run_id", "p", "--metrics.mlflow.price_per_hour", "3",
         "--metrics.mlflow.instance_type", "p5.48xlarge"],
    )  # fmt: skip
    assert mlflow_fields(overridden) == {
        "enable": False,
        "tracking_uri": "sqlite:////flag.db",
        "experiment": "flag-experiment",
        "run_name": "r",
        "parent_run_id": "p",
        "price_per_hour": 3.0,
        "instance_type": "p5.48xlarge",
    }


def test_without_the_environment_the_defaults_are_local(monkeypatch, tmp_path):
    for name in [*SETTINGS_ENV, "MLFLOW_EXPERIMENT_NAME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert mlflow_fields(load_config("tiny_moe", [])) == {
        "enable": True,
        "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "experiment": "qwentitan-tiny",
        "run_name": None,
        "parent_run_id": None,
        "price_per_hour": None,
        "instance_type": None,
    }


def test_a_bad_price_in_the_environment_is_one_sentence(monkeypatch):
    monkeypatch.setenv("QWENTITAN_PRICE_PER_HOUR", "cheap")
    with pytest.raises(LaunchError, match=r"QWENTITAN_PRICE_PER_HOUR='cheap' is not a number"):
        recipes.get_recipe("tiny_dense")()


def test_trn2_model_folder_from_the_environment_or_torchtitan_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("QWENTITAN_QWEN3_4B_DIR", str(tmp_path / "env-4b"))
    config = load_config("qwen3_4b_hf", [])
    assert config.hf_assets_path == config.checkpoint.initial_load_path == str(tmp_path / "env-4b")
    flag = str(tmp_path / "flag-4b")
    config = load_config(
        "qwen3_4b_hf", ["--hf_assets_path", flag, "--checkpoint.initial_load_path", flag]
    )
    assert config.hf_assets_path == config.checkpoint.initial_load_path == flag
    monkeypatch.delenv("QWENTITAN_QWEN3_4B_DIR")
    monkeypatch.chdir(tmp_path)
    default = str(tmp_path / "assets" / "hf" / "Qwen3-4B-Instruct-2507")
    assert load_config("qwen3_4b_native", []).hf_assets_path == default


def test_one_registry_names_every_recipe_and_its_path():
    names = recipes.recipe_names()
    assert plan.recipe_names() == names
    assert set(recipes.TRN2_RECIPES) == {
        "qwen3_4b_hf",
        "qwen3_4b_native",
        "qwen3_8b_tp4_fsdp16_sac",
        "qwen3_30b_a3b_tp4_fsdp16",
        "qwen3_moe_kernels",
    }
    # the pilot's pairs name registered recipes, each on the path its child run is named for
    for pair in PAIRS.values():
        for child, recipe in zip(pair.children, pair.recipes, strict=True):
            assert recipes.recipe_info(recipe).path == child.removesuffix("-moe"), recipe
    for name in names:
        config = recipes.get_recipe(name)()
        # the recipe tags its runs with the registry's path, and plans for its instance
        assert config.metrics.mlflow.recipe == name
        assert config.metrics.mlflow.path == recipes.recipe_info(name).path, name
    assert plan.default_instance("qwen3_4b_hf") == "trn2.48xlarge"
    assert plan.default_instance("tiny_dense") in ("cpu", "cuda")
    with pytest.raises(
        LaunchError,
        match="Unknown recipe 'tiny_gpt'; choose one of qwen3_30b_a3b_tp4_fsdp16, qwen3_4b_hf",
    ):
        recipes.recipe_info("tiny_gpt")


@pytest.mark.parametrize("name", recipes.recipe_names())
def test_every_recipe_sets_qwentitans_components_and_overrides_keep_them(name):
    """The checkpoint manager, validator and metrics come in as the recipe's Config classes (not
    rewrapped at run time), and torchtitan's command line changes their fields, not their class."""
    from qwentitan.launch.runtime.checkpointer import GuardedCheckpointManager
    from qwentitan.launch.runtime.validator import PausableValidator
    from qwentitan.launch.tracking.processor import TrackedMetrics

    config = load_config(name, ["--checkpoint.interval", "7", "--validator.freq", "3"])
    assert type(config.checkpoint) is GuardedCheckpointManager.Config
    assert type(config.validator) is PausableValidator.Config
    assert type(config.metrics) is TrackedMetrics.Config
    assert (config.checkpoint.interval, config.validator.freq) == (7, 3)


def test_train_passes_overrides_after_the_double_dash_to_every_rank(monkeypatch, tmp_path):
    from qwentitan.launch.launcher import supervisor

    started: list[list[str]] = []

    def fake_supervise(command, env, **_):
        started.append(list(command))
        return 0

    monkeypatch.setattr(supervisor, "supervise", fake_supervise)
    extra = ["--metrics.mlflow.parent_run_id", "abc", "--metrics.mlflow.run_name", "native"]
    assert cli.main(["train", "--run-dir", str(tmp_path), "--", *extra]) == 0
    (torchrun,) = [c for c in started if "torchtitan.train" in c]
    assert torchrun[-len(extra) :] == extra


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (["--metrics.mlflow.parent_runid", "abc"], "--metrics.mlflow.parent_runid"),
        (["--metrics.mlflow.price_per_hour", "-3"], "metrics.mlflow.price_per_hour is -3.0"),
    ],
)
def test_train_refuses_a_bad_override_before_any_rank_starts(
    monkeypatch, tmp_path, capsys, override, named
):
    from qwentitan.launch.launcher import supervisor

    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: pytest.fail("a rank started"))
    assert cli.main(["train", "--run-dir", str(tmp_path), "--", *override]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "\n" not in err.strip()
    assert named in err
