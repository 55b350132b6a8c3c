"""The pilot's picture: every child's loss curve on one plot, each pair's |loss difference| below
(its training loss, and its validation loss dotted)."""

from __future__ import annotations

from pathlib import Path

from qwentitan.checkpoint.files import atomic_file
from qwentitan.launch.launcher.pilot.compare import LOSS, PairResult

# Differences of exactly zero (bit-identical steps) have no place on a log axis; a symmetric
# log axis shows them at 0 and stays logarithmic above this.
_LINEAR_BELOW = 1e-9


def plot_losses(
    losses: dict[str, dict[int, float]],
    results: list[PairResult],
    file: Path,
    title: str = "pilot: every path from the same weights, data and steps",
) -> Path:
    """Write the PNG to `file` (through a temporary sibling) and return it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training host
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (curves, gaps) = plt.subplots(
        2, 1, sharex=True, figsize=(12, 8), height_ratios=(2, 1), layout="constrained"
    )
    # The mesh pilot's 13 children and 11 differences: 20 colours, so none repeats.
    palette = plt.get_cmap("tab20").colors if len(losses) + len(results) > 10 else None
    palette = list(palette or plt.rcParams["axes.prop_cycle"].by_key()["color"])
    curves.set_prop_cycle(color=palette)
    # The second child of a pair dashed, so a curve drawn exactly over its twin still shows.
    dashed = {result.pair.children[1] for result in results}
    for child, curve in losses.items():
        steps = sorted(curve)
        style = "--" if child in dashed else "-"
        curves.plot(steps, [curve[s] for s in steps], style, marker=".", label=child)
    curves.set_ylabel("training loss")
    curves.set_title(title)
    # Colours after the children's, so a difference is not read as one of the curves.
    gaps.set_prop_cycle(color=palette[len(losses) :] + palette[: len(losses)])
    for result in results:
        steps = sorted(result.diffs)
        left, right = result.pair.children
        label = f"|{left} - {right}|" + ("" if result.metric == LOSS else " validation")
        style = "-" if result.metric == LOSS else ":"  # validation: a few steps, dotted
        gaps.plot(steps, [result.diffs[s] for s in steps], style, marker=".", label=label)
    for limit in sorted({result.pair.limit for result in results}):
        gaps.axhline(limit, color="grey", linestyle="--", linewidth=1)
    gaps.set_yscale("symlog", linthresh=_LINEAR_BELOW)
    gaps.set_ylim(bottom=0)
    gaps.xaxis.set_major_locator(MaxNLocator(integer=True))
    gaps.set_ylabel("|loss difference|\n(dotted: validation;\ndashed: limit)")
    gaps.set_xlabel("step")
    for axes in (curves, gaps) if losses else ():  # nothing trained: no legend to show
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    try:
        with atomic_file(file) as partial:
            figure.savefig(partial, dpi=100, format="png")
    finally:
        plt.close(figure)
    return file
