"""Preflight checks of the weights: folder against the flavor, HF -> DCP -> HF, initialisation loss."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

from qwentitan.checkpoint import (
    CheckpointError,
    HFFolder,
    Qwen3Layout,
    read_config,
    to_dcp,
    to_hf,
    verify,
)
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

# Above this size the round trip converts one layer (plus embeddings and norms), for speed.
ROUND_TRIP_FULL_LIMIT = 1 << 30
# Loaded weights must give at most this fraction of a random initialisation's loss. The guide
# saw 6.54 against 12.43 for Qwen3-4B (0.53); a tiny model after 40 CPU steps reaches about 0.7,
# while weights that did not load, or were never trained, sit near 1.0.
INIT_LOSS_RATIO = 0.8


def weights_folder(plan: LaunchPlan, override: str | None = None) -> Path:
    ckpt = plan.config.checkpoint
    folder = override or getattr(ckpt, "initial_load_path", None) or plan.config.hf_assets_path
    return Path(folder).expanduser()


def random_init_reason(plan: LaunchPlan, override: str | None = None) -> str | None:
    """Why the weights checks do not apply to this plan (it loads no weights), else None.

    torchtitan loads initial weights only from `checkpoint.initial_load_path`; `hf_assets_path`
    alone is the tokenizer's folder. A folder passed with --weights is checked all the same.
    """
    if override or getattr(plan.config.checkpoint, "initial_load_path", None):
        return None
    return "the recipe starts from random weights (no checkpoint.initial_load_path); --weights DIR checks a folder anyway"


def _flavor(plan: LaunchPlan):
    from qwentitan.modeling import get_flavor

    return get_flavor(plan.config.model_spec.flavor)


def expected_shapes(flavor) -> dict[str, tuple[int, ...]]:
    """Keys and shapes a Hub folder of the flavor holds (experts one tensor each, tied head
    omitted): qwentitan.checkpoint's layout, the one the converter checks folders against."""
    from qwentitan.modeling import flavor_to_hf_config

    return Qwen3Layout.from_config(flavor_to_hf_config(flavor).to_dict(), flavor.name).hf_shapes()


def check_weights(plan: LaunchPlan, folder: Path) -> CheckResult:
    flavor = _flavor(plan)
    if not folder.is_dir():
        return CheckResult("weights", "fail", f"no weights folder at {folder}; {_get_it(plan)}")
    if not (folder / "config.json").exists():
        return CheckResult(
            "weights", "fail", f"{folder} lacks config.json; export or copy the model there"
        )
    try:
        hub = HFFolder(folder)  # every header and the index checked: a damaged file is named
    except CheckpointError as error:
        return CheckResult("weights", "fail", str(error))
    found = {name: hub.shape(name) for name in hub.tensors}
    files = hub.files
    wanted = expected_shapes(flavor)
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted))
    wrong = sorted(k for k in set(wanted) & set(found) if wanted[k] != found[k])
    figures = {
        "tensors": len(found),
        "expected": len(wanted),
        "missing": missing[:5],
        "unexpected": unexpected[:5],
        "wrong_shape": [(k, found[k], wanted[k]) for k in wrong[:5]],
        "bytes": sum(f.stat().st_size for f in files),
    }
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} with wrong shapes (e.g. {k} {found[k]} != {wanted[k]})")
        return CheckResult(
            "weights",
            "fail",
            f"{folder} does not hold flavor {flavor.name}: " + "; ".join(parts),
            figures,
        )
    return CheckResult(
        "weights",
        "pass",
        f"{len(found)} tensors in {len(files)} file(s) match flavor {flavor.name} ({figures['bytes'] / 1e9:.2f} GB)",
        figures,
    )


def _get_it(plan: LaunchPlan) -> str:
    """How to put the recipe's model folder on the host, in a few words."""
    from qwentitan.launch.launcher.commands.fetch import fetch_command
    from qwentitan.launch.recipes import recipe_info

    hub = recipe_info(plan.recipe).hub_model
    if hub is None:
        return "set the path (--weights)"
    return f"download {hub} there with `{fetch_command(plan.recipe)}`, or pass --weights DIR"


def _one_layer_copy(folder: Path, dst: Path) -> Path:
    """A smaller model folder: layer 0 plus the non-layer tensors, config cut to one layer."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    config, _ = read_config(folder)
    config["num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    hub = HFFolder(folder)
    tensors = {
        key: hub.read(key) for key in hub.tensors if ".layers." not in key or ".layers.0." in key
    }
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def check_round_trip(plan: LaunchPlan, folder: Path) -> CheckResult:
    size = sum(f.stat().st_size for f in HFFolder(folder).files)
    with tempfile.TemporaryDirectory(prefix="qwentitan-preflight-") as tmp:
        source = folder
        scope = "all layers"
        if size > ROUND_TRIP_FULL_LIMIT:
            source = _one_layer_copy(folder, Path(tmp) / "one-layer")
            scope = "layer 0 + embeddings (model over 1 GiB)"
        dcp = to_dcp(source, Path(tmp) / "dcp")
        report = verify(source, dcp)
        before, after = HFFolder(source), HFFolder(to_hf(dcp, Path(tmp) / "hf"))
        differing = sorted(set(before.tensors) ^ set(after.tensors))[:3]
        if not differing:
            differing = [
                k for k in sorted(before.tensors) if not torch.equal(before.read(k), after.read(k))
            ]
    figures = {
        "tensors": len(before.tensors),
        "scope": scope,
        "verify_ok": report.ok,
        "differing": differing,
    }
    if not report.ok or differing:
        what = differing[0] if differing else "verify reported differences"
        return CheckResult(
            "round_trip", "fail", f"HF -> DCP -> HF changed the weights ({what})", figures
        )
    return CheckResult(
        "round_trip",
        "pass",
        f"HF -> DCP -> HF bitwise identical, {len(before.tensors)} tensors ({scope})",
        figures,
    )


def _one_batch(plan: LaunchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch the run itself would train on (its tokenizer and dataloader)."""
    config = plan.config
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
    )
    inputs, labels = next(iter(loader))
    tokens = inputs["input"] if isinstance(inputs, dict) else inputs
    return tokens, labels


def _loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return float(
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    )


def check_initialisation(plan: LaunchPlan, folder: Path, host: str) -> CheckResult:
    if host != plan.topology.device_type:
        return CheckResult(
            "initialisation",
            "skip",
            f"runs on the target device ({plan.topology.device_type}), not {host}",
        )
    from transformers import AutoModelForCausalLM

    from qwentitan.modeling import flavor_to_hf_config

    tokens, labels = _one_batch(plan)
    device = torch.device(host)
    tokens, labels = tokens.to(device), labels.to(device)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    loaded_loss = _loss(loaded, tokens, labels)
    del loaded
    torch.manual_seed(0)
    random = AutoModelForCausalLM.from_config(flavor_to_hf_config(_flavor(plan))).to(device).eval()
    random_loss = _loss(random, tokens, labels)
    ratio = loaded_loss / random_loss if random_loss > 0 else math.inf
    figures = {
        "loaded_loss": round(loaded_loss, 4),
        "random_loss": round(random_loss, 4),
        "ratio": round(ratio, 4),
        "max_ratio": INIT_LOSS_RATIO,
        "tokens": int(tokens.numel()),
    }
    ok = ratio <= INIT_LOSS_RATIO
    return CheckResult(
        "initialisation",
        "pass" if ok else "fail",
        f"loss {loaded_loss:.2f} with the loaded weights vs {random_loss:.2f} at random init "
        f"(ratio {ratio:.2f}, must be <= {INIT_LOSS_RATIO})"
        + ("" if ok else "; the weights did not load or are not trained"),
        figures,
    )
