"""The pilot: every implementation path trained from the same weights, compared in MLflow.

`uv run nox -s pilot [-- --steps 20 --ranks 2]` writes one seeded tiny dense and one tiny MoE
Hugging Face checkpoint, then trains each pair of paths from it as `qwentitan-launch train` would, planned and
launched from this process (same seed, data order, steps and world size): `hf` and `native` on the dense one,
`native-moe` and `moe-kernels` on the MoE one (torchtitan's experts in float32 on CPU, like the
kernel experts). Each training is a child run of one MLflow parent in the `qwentitan-pilot`
experiment; the parent gets each pair's per-step |loss difference|, its |validation loss
difference| at the steps the children validated, their maxima, a PNG of all curves, and fails
when a pair differs by more than its limit at any step of either. The last line printed
is the URL that opens the children side by side in the MLflow UI (`uv run nox -s mlflow_ui`).

The mesh pilot (`qwentitan-launch pilot --mesh`) runs the same way over the pairs of `mesh`: each
child places its recipe on its own layout and starts from the recipe's initialisation with the
pilot's seed (`--debug.seed`), all on one global batch, so a layout that trains another model or
other data shows as a loss difference to its baseline.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qwentitan.checkpoint.files import atomic_folder
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.pilot.compare import (
    LOSS,
    PAIRS,
    PILOT_LR,
    VALIDATION,
    Pair,
    PairResult,
    compare,
)
from qwentitan.launch.launcher.pilot.mesh import DEGREES, MESH, MESH_GLOBAL_BATCH, MESH_LOCAL_BATCH
from qwentitan.launch.launcher.pilot.plot import plot_losses
from qwentitan.launch.launcher.plan import resolve_plan
from qwentitan.launch.launcher.plan_cli import LAYOUT
from qwentitan.launch.launcher.request import RunRequest
from qwentitan.launch.launcher.run_folder import new_run_folder, point_latest
from qwentitan.launch.launcher.supervisor import SignalForwarder, ranks_of
from qwentitan.launch.tracking.links import compare_url, loss_url, runs_url
from qwentitan.launch.tracking.logger import resolve_tracking_uri
from qwentitan.launch.tracking.store import PARENT_TAG, MlflowTarget, now_ms, without_credentials

PILOT_EXPERIMENT = "qwentitan-pilot"
PLOT = "pilot_losses.png"
# `--perturb CHILD` starts that child from a copy of its pair's checkpoint with this weight
# scaled by PERTURB_SCALE (a mesh child: from its recipe's initialisation with the next seed):
# the pilot must then fail, which shows its check can.
PERTURBED_WEIGHT = "model.norm.weight"
PERTURB_SCALE = 1.1
_COLUMNS = (
    "summary/final_loss",
    "summary/warmup_time_s",
    "summary/sustained_step_time_s",
    "summary/sustained_tokens_per_second",
)


@dataclass(frozen=True, slots=True)
class Pilot:
    parent_run_id: str
    children: dict[str, str]  # child name (its path) -> run id
    failed: list[str]  # children whose training exited with an error
    pairs: list[PairResult]
    tracking_uri: str
    compare_url: str
    loss_url: str
    plot: Path

    @property
    def passed(self) -> bool:
        return not self.failed and all(result.passed for result in self.pairs)


def pilot_request(**fields: object) -> RunRequest:
    """The children's common request: 20 steps on 2 ranks unless `fields` say otherwise."""
    first = next(iter(PAIRS.values())).recipes[0]
    return RunRequest(**{"recipe": first, "steps": 20, "ranks_per_node": 2, **fields})


def run_pilot(
    request: RunRequest | None = None,
    tracking_uri: str | None = None,
    experiment: str = PILOT_EXPERIMENT,
    *,
    pairs: Sequence[str] = tuple(PAIRS),
    seed: int = 0,
    lr: float = PILOT_LR,
    perturb: str | None = None,
) -> Pilot:
    """Train the `pairs` (names in PAIRS) as children of one new parent run, each child
    `request` with its own recipe and run folder; see the module."""
    request = request or pilot_request()
    chosen = _chosen(pairs, perturb, request)
    if any(pair.flavor is None for pair in chosen):  # a mesh pair: one global batch for all
        request = request.replace(
            global_batch_size=request.global_batch_size or MESH_GLOBAL_BATCH,
            local_batch_size=request.local_batch_size or MESH_LOCAL_BATCH,
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # without --run-dir a new folder under outputs/pilot, which `latest` then names, as train's
    new = request.run_dir is None
    folder = Path(request.run_dir or new_run_folder(Path("outputs") / "pilot")).absolute()
    children = {
        child: request.replace(recipe=recipe, run_dir=str(folder / child), **_placed(layout))
        for pair in chosen
        for child, recipe, layout in zip(pair.children, pair.recipes, pair.layouts, strict=True)
    }
    for child in children.values():
        resolve_plan(child)  # every child's plan is checked before anything is written
    uri = resolve_tracking_uri(tracking_uri)
    if new:
        point_latest(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
    target = MlflowTarget(uri)
    parent = _open_parent(target, experiment, stamp, request, chosen, seed, lr, perturb)
    try:
        failed = _train_children(
            children, chosen, folder, parent, uri, experiment, seed, lr, perturb
        )
        runs = _child_runs(target, parent, children, failed)
        curves = {
            metric: {c: _history(target, runs[c], metric) for c in children if c in runs}
            for metric in (LOSS, VALIDATION)
        }
        losses = curves[LOSS]
        steps = request.steps or 0
        results = [
            result
            for pair in chosen
            for metric in (LOSS, VALIDATION)
            if (result := compare(pair, curves[metric], steps, metric)) is not None
        ]
        plot = plot_losses(losses, results, folder / PLOT, title=_title(chosen))
        _log_results(target, parent, results, plot)
    except BaseException as error:  # Ctrl-C (the child saved and stopped), a full disk
        target.end(parent, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED", now_ms())
        raise
    passed = not failed and all(r.passed for r in results)
    target.log(parent, tags={"pilot.failed": ",".join(failed) or "none",
                             "pilot.result": "passed" if passed else "failed"})  # fmt: skip
    target.end(parent, "FINISHED" if passed else "FAILED", now_ms())
    return _report(target, uri, parent, runs, failed, results, plot, list(children))


def _chosen(pairs: Sequence[str], perturb: str | None, request: RunRequest) -> list[Pair]:
    known = {**PAIRS, **MESH}
    chosen = [known[name] for name in dict.fromkeys(pairs) if name in known]
    if len(chosen) != len(set(pairs)) or not chosen:
        raise LaunchError(
            f"Unknown pair in {list(pairs)}; choose among {', '.join(PAIRS)} or the mesh "
            f"pilot's {', '.join(MESH)}."
        )
    children = list(dict.fromkeys(child for pair in chosen for child in pair.children))
    if perturb is not None and perturb not in children:
        raise LaunchError(f"--perturb {perturb!r} is none of this pilot's children: {children}.")
    placed = any(layout for pair in chosen for layout in pair.layouts)
    if placed and (given := next((f for f in DEGREES if getattr(request, f)), None)):
        raise LaunchError(
            f"The mesh pilot places every child on its own layout; drop {{{given}}}.", field=given
        )
    return chosen


def _placed(layout: tuple[tuple[str, int], ...]) -> dict[str, object]:
    """The request fields that put a child on `layout` (none for a child without one)."""
    return {**dict.fromkeys(DEGREES), **dict(layout)} if layout else {}


def _title(chosen: list[Pair]) -> str:
    if all(pair.flavor is None for pair in chosen):
        return "mesh pilot: every layout from the same seed, global batch and steps"
    return "pilot: every path from the same weights, data and steps"


def _open_parent(
    target: MlflowTarget,
    experiment: str,
    stamp: str,
    request: RunRequest,
    chosen: list[Pair],
    seed: int,
    lr: float,
    perturb: str | None,
) -> str:
    """The parent run, with the pilot's parameters and the limit of each pair."""
    name = "mesh-pilot" if all(pair.flavor is None for pair in chosen) else "pilot"
    parent = target.open_run(
        {"run_key": uuid.uuid4().hex, "experiment": experiment, "run_name": f"{name}-{stamp}",
         "start_ms": now_ms()}
    )  # fmt: skip
    sizes = {"steps": request.steps, "ranks": request.ranks_per_node}
    sizes |= {name: getattr(request, name) for name in ("seq_len", "local_batch_size", *LAYOUT)}
    children = list(dict.fromkeys(child for pair in chosen for child in pair.children))
    target.log(
        parent,
        params={**{k: str(v) for k, v in sizes.items() if v is not None},
                "seed": str(seed), "lr": f"{lr:g}",
                **{f"limit.{p.name}": f"{p.limit:g}" for p in chosen}},
        tags={"pilot.children": ",".join(children), "pilot.perturbed": perturb or "none"},
    )  # fmt: skip
    return parent


def _train_children(
    children: dict[str, RunRequest],
    chosen: list[Pair],
    folder: Path,
    parent: str,
    uri: str,
    experiment: str,
    seed: int,
    lr: float,
    perturb: str | None,
) -> list[str]:
    """Train every child in turn (once, whatever the number of its pairs), each from its pair's
    start, as `train` does; the failed ones. Signals reach the running child's ranks, and stop
    the pilot after it (KeyboardInterrupt)."""
    flavors = {child: pair.flavor for pair in chosen for child in pair.children}
    failed = []
    with SignalForwarder(ranks_of, interrupting=True) as forwarder:
        for child, request in children.items():
            start, said = _start(folder, flavors[child], seed, perturbed=child == perturb)
            overrides = [*start, _LR, f"{lr:g}", *child_overrides(uri, experiment, parent, child)]
            request = request.replace(overrides=(*overrides, *request.overrides))
            print(f"pilot: {child} ({request.recipe}) from {said}", flush=True)
            if _train_child(request, forwarder) != 0:
                failed.append(child)
    return failed


def _train_child(request: RunRequest, forwarder: SignalForwarder) -> int:
    """Plan, check and train the child of `request` as `train` does, its ranks started under
    `forwarder`; a refusal is printed as `train` says it, and is exit code 2."""
    from qwentitan.launch.launcher.cli import user_errors
    from qwentitan.launch.launcher.commands.train import plan_training, train_plan
    from qwentitan.launch.launcher.plan_cli import flag_of
    from qwentitan.launch.launcher.run_folder import check_run_folder

    try:
        check_run_folder(Path(request.run_dir or "."))
        plan, said = plan_training(request, folder_given=True)
    except user_errors() as error:
        sentence = error.phrased(flag_of) if isinstance(error, LaunchError) else error
        print(f"qwentitan-launch train: {sentence}", file=sys.stderr, flush=True)
        return 2
    return train_plan(plan, said, supervise=forwarder.run)


def _start(folder: Path, flavor: str | None, seed: int, *, perturbed: bool) -> tuple[list, str]:
    """The overrides that start a child, and where from in words: the pair's seeded checkpoint
    of `flavor`, or (None) the recipe's own initialisation with `seed` (the next one perturbed)."""
    if flavor is None:
        seed += perturbed
        return ["--debug.seed", str(seed)], f"its initialisation with seed {seed}"
    start = _start_checkpoint(folder / "start" / flavor, flavor, seed)
    weights = _perturbed(start) if perturbed else start
    return start_overrides(weights), str(weights)


def _child_runs(
    target: MlflowTarget, parent: str, children: dict[str, RunRequest], failed: list[str]
) -> dict[str, str]:
    """Child name -> MLflow run id of every child logged under `parent`."""
    experiment_id = target.client.get_run(parent).info.experiment_id
    runs = {
        run.info.run_name: run.info.run_id
        for run in target.client.search_runs(
            [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'"
        )
    }
    if missing := [c for c in children if c not in failed and c not in runs]:
        raise LaunchError(
            f"The {', '.join(missing)} run(s) trained but logged no MLflow run under parent "
            f"{parent}; the recipes' metrics must be "
            "qwentitan.launch.tracking.tracked_metrics(...)."
        )
    return runs


def _report(
    target: MlflowTarget,
    uri: str,
    parent: str,
    runs: dict[str, str],
    failed: list[str],
    results: list[PairResult],
    plot: Path,
    children: list[str],
) -> Pilot:
    """Print the table, the verdicts and the UI pages; the Pilot they describe."""
    experiment_id = target.client.get_run(parent).info.experiment_id
    _print_table(target, {child: runs[child] for child in children if child in runs})
    for result in results:
        print(f"pilot: {result.verdict()}")
    if failed:
        print(f"pilot: the {', '.join(failed)} run(s) failed to train (see their log above)")
    trained = [runs[c] for c in children if c in runs]
    uri = without_credentials(uri)  # shown and returned: the address without user and password
    url = compare_url(uri, experiment_id, trained)
    losses_page = loss_url(uri, experiment_id, trained)
    print(f"pilot: parent run {parent} in {uri}; curves in {plot}")
    if not uri.startswith(("http://", "https://")):
        print("pilot: serve the UI with `uv run nox -s mlflow_ui`, then open")
    print(f"runs:    {runs_url(uri, experiment_id)}")
    print(f"loss:    {losses_page}")
    print(f"compare: {url}", flush=True)
    return Pilot(parent, runs, failed, results, uri, url, losses_page, plot)


# torchtitan 0.3.0 keeps the learning rate in its optimizer's parameter groups; the tiny
# recipes have one (torchtitan's default_adamw).
_LR = "--optimizer.param-groups.0.optimizer-kwargs.lr"


def start_overrides(folder: Path) -> list[str]:
    """The torchtitan overrides that start a training from the HF checkpoint in `folder`."""
    return [
        "--checkpoint.initial_load_path", str(folder.resolve()),  # torchtitan wants it absolute
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
    ]  # fmt: skip


def child_overrides(uri: str, experiment: str, parent_run_id: str, run_name: str) -> list[str]:
    """The torchtitan overrides that log one training as a child of the pilot's parent run."""
    return [
        "--metrics.mlflow.enable",  # the pilot exists to compare runs in MLflow
        "--metrics.mlflow.tracking_uri", uri,
        "--metrics.mlflow.experiment", experiment,
        "--metrics.mlflow.parent_run_id", parent_run_id,
        "--metrics.mlflow.run_name", run_name,
    ]  # fmt: skip


def _start_checkpoint(folder: Path, flavor: str, seed: int) -> Path:
    from safetensors import SafetensorError

    from qwentitan.modeling.initial_checkpoint import write_initial_checkpoint

    if not folder.exists():  # a resumed pilot folder keeps the weights it started from
        print(f"pilot: writing the seeded {flavor} checkpoint to {folder}", flush=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_initial_checkpoint(flavor, folder, seed=seed)
        except SafetensorError as error:  # safetensors' own type for a failed write
            text = str(error)
            full = "No space left" in text or "StorageFull" in text
            reason = "no space left on the disk" if full else text.splitlines()[0][:120]
            raise LaunchError(
                f"Could not write the seeded checkpoint {folder} ({reason}); free some space or "
                "pass {run_dir} on another disk.",
                field="run_dir",
            ) from None
    return folder


def _perturbed(start: Path) -> Path:
    """A copy of the checkpoint in `start` with PERTURBED_WEIGHT scaled by PERTURB_SCALE."""
    from safetensors.torch import load_file, save_file

    folder = start.with_name(f"{start.name}-perturbed")
    if folder.exists():
        return folder
    with atomic_folder(folder) as partial:
        shutil.copytree(start, partial, dirs_exist_ok=True)
        for file in partial.glob("*.safetensors"):
            tensors = load_file(file)
            if PERTURBED_WEIGHT in tensors:
                tensors[PERTURBED_WEIGHT] = tensors[PERTURBED_WEIGHT] * PERTURB_SCALE
                save_file(tensors, file, metadata={"format": "pt"})
    return folder


def _history(target: MlflowTarget, run_id: str, metric: str) -> dict[int, float]:
    return {m.step: m.value for m in target.client.get_metric_history(run_id, metric)}


def _log_results(target: MlflowTarget, parent: str, results: list[PairResult], plot: Path) -> None:
    from qwentitan.launch.tracking.store import Point

    ms = now_ms()
    points: list[Point] = []
    tags = {}
    for result in results:
        key = result.key
        points += [(f"{key}/abs_loss_diff", d, ms, s) for s, d in sorted(result.diffs.items())]
        if result.max_diff is not None:
            points.append((f"{key}/max_abs_loss_diff", result.max_diff, ms, 0))
        tags[f"{key}/result"] = "passed" if result.passed else "failed"
        tags[f"{key}/verdict"] = result.verdict()
    target.log(parent, points, tags=tags)
    target.log_artifact(parent, plot, "plots")


def _print_table(target: MlflowTarget, children: dict[str, str]) -> None:
    width = max([12, *(len(child) + 2 for child in children)])
    print(f"{'child':<{width}}" + "".join(f"{c.removeprefix('summary/'):>30}" for c in _COLUMNS))
    for child, run_id in children.items():
        metrics = target.client.get_run(run_id).data.metrics
        cells = "".join(f"{metrics[c]:>30.4g}" if c in metrics else f"{'-':>30}" for c in _COLUMNS)
        print(f"{child:<{width}}{cells}")
