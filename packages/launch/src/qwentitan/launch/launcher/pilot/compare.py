"""The pilot's pairs: two children started from the same weights, compared step by step; the
paths pilot's (two implementation paths from one checkpoint) are PAIRS, the mesh pilot's (one
layout against its baseline) are in `mesh`."""

from __future__ import annotations

from dataclasses import dataclass

Layout = tuple[tuple[str, int], ...]
"""Request fields (ranks_per_node, tp, fsdp, ...) that place one child; empty: the pilot's own."""


@dataclass(frozen=True, slots=True)
class Pair:
    """Two children that train one flavor from the same weights, data and steps."""

    name: str
    flavor: str | None
    """The flavor of the seeded checkpoint both children start from; None: each starts from its
    recipe's own initialisation with the pilot's seed, which is the same whatever the layout."""
    children: tuple[str, str]
    """The child runs' names (their implementation paths or layouts), left and right; a child
    named in several pairs trains once."""
    recipes: tuple[str, str]
    limit: float
    """The largest |loss difference| allowed at any step."""
    layouts: tuple[Layout, Layout] = ((), ())
    kind: str = "pair"
    """What the verdict calls it ("pair": two paths; "layout": a layout against its baseline)."""


# Every child's learning rate. The tiny recipes' 1e-2 trains fast but spikes now and then
# (loss 8.3 -> 10.2 at one step in a 20-step run), and that spike magnified the float32
# rounding difference between hf and native a thousandfold. The pilot compares paths, so it
# trains where a step is well conditioned.
PILOT_LR = 3e-3

PAIRS: dict[str, Pair] = {
    pair.name: pair
    for pair in (
        # Both float32 end to end: what differs is the order of float32 operations inside two
        # implementations of the same model, which training may amplify only a little.
        Pair("dense", "tiny-dense", ("hf", "native"), ("tiny_hf", "tiny_dense"), 1e-4),
        # The router's top-k can flip on a near-tie, so the MoE pair gets ten times the room.
        Pair(
            "moe", "tiny-moe", ("native-moe", "moe-kernels"), ("tiny_moe", "tiny_moe_kernels"), 1e-3
        ),
    )
}


# The curves a pair is judged on, by MLflow metric key: the training loss at every step, and the
# validation loss at the steps the children validated (torchtitan's step 1 and every
# `--validate-every`), which reads the same held-out windows on any layout.
LOSS = "loss"
VALIDATION = "validation/loss"
_WORDS = {LOSS: "loss", VALIDATION: "validation loss"}


@dataclass(frozen=True, slots=True)
class PairResult:
    pair: Pair
    diffs: dict[int, float]
    """Step -> |loss difference|, for the steps both children logged."""
    missing: dict[str, list[int]]
    """Child -> the steps it did not log (a child that did not train misses all)."""
    metric: str = LOSS
    """The curve compared: LOSS or VALIDATION."""

    @property
    def key(self) -> str:
        """Where the parent run records it: `layout/NAME`, `layout/NAME/validation`."""
        head = f"{self.pair.kind}/{self.pair.name}"
        return head if self.metric == LOSS else f"{head}/{self.metric.split('/')[0]}"

    @property
    def max_diff(self) -> float | None:
        return max(self.diffs.values()) if self.diffs else None

    @property
    def first_over(self) -> int | None:
        """The first step whose difference exceeds the limit (None: none does)."""
        return next((s for s, d in sorted(self.diffs.items()) if not d <= self.pair.limit), None)

    @property
    def passed(self) -> bool:
        return self.first_over is None and not any(self.missing.values())

    def verdict(self) -> str:
        """One line: the pair, its worst difference and whether it is within the limit."""
        left, right = self.pair.children
        words = _WORDS[self.metric]
        head = f"{self.pair.name} {self.pair.kind} ({left} vs {right})"
        head += "" if self.metric == LOSS else f" {words}"
        if missing := {child: steps for child, steps in self.missing.items() if steps}:
            said = "; ".join(
                f"{c} logged no {words} for step(s) {_steps(s)}" for c, s in missing.items()
            )
            return f"{head}: FAILED, {said}"
        worst = max(self.diffs, key=self.diffs.__getitem__)
        summary = f"max |{words} difference| {self.diffs[worst]:.2e} at step {worst}"
        if (step := self.first_over) is not None:
            return (
                f"{head}: FAILED, |{words} difference| {self.diffs[step]:.2e} at step {step} "
                f"exceeds the limit {self.pair.limit:.0e} ({summary})"
            )
        return (
            f"{head}: passed, {summary} over {len(self.diffs)} step{'s' * (len(self.diffs) != 1)} "
            f"(limit {self.pair.limit:.0e})"
        )


def compare(
    pair: Pair, curves: dict[str, dict[int, float]], steps: int, metric: str = LOSS
) -> PairResult | None:
    """Compare the pair's two curves of `metric` (child -> step -> value): the training loss over
    steps 1..steps; the validation loss at each step up to `steps` that either child validated
    (None when neither did: there is nothing to judge)."""
    left, right = (curves.get(child, {}) for child in pair.children)
    if metric == LOSS:
        wanted = list(range(1, steps + 1))
    elif not (wanted := sorted(s for s in {*left, *right} if s <= steps)):
        return None
    return PairResult(
        pair,
        diffs={s: abs(left[s] - right[s]) for s in wanted if s in left and s in right},
        missing={
            child: [s for s in wanted if s not in curve]
            for child, curve in zip(pair.children, (left, right), strict=True)
        },
        metric=metric,
    )


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
