"""`verify`: does a DCP folder hold exactly the weights of a Hugging Face folder?"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwentitan.checkpoint import dcp_read
from qwentitan.checkpoint.convert import THREADS, check_hf_tensors
from qwentitan.checkpoint.disk import differing_elements
from qwentitan.checkpoint.hf_export import MEMORY_BUDGET
from qwentitan.checkpoint.layout import NON_MODEL_PREFIXES, Qwen3Layout, TitanTensor, read_config
from qwentitan.checkpoint.logits import RELATIVE_TOLERANCE
from qwentitan.checkpoint.safetensors_io import HFFolder, read_into


@dataclass(frozen=True, slots=True)
class ValueDifference:
    """A tensor whose bytes differ: how many elements, and the largest absolute difference."""

    name: str
    differing: int
    numel: int
    max_abs_diff: float


@dataclass(slots=True)
class VerifyReport:
    """What `verify` compared and every difference it found; `ok` when there is none."""

    hf_dir: Path
    dcp_dir: Path
    compared: int = 0
    compared_bytes: int = 0
    missing_in_dcp: list[str] = field(default_factory=list)
    unexpected_in_dcp: list[str] = field(default_factory=list)
    shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list
    )
    dtype_mismatches: list[tuple[str, torch.dtype, torch.dtype]] = field(default_factory=list)
    value_mismatches: list[ValueDifference] = field(default_factory=list)
    nonzero_expert_bias: list[str] = field(default_factory=list)
    logits_max_abs_diff: float | None = None
    logits_tolerance: float | None = None
    # With logits: the weights holding NaN or Inf (logits computed from them are not finite).
    nonfinite_tensors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        logits_ok = self.logits_max_abs_diff is None or (
            self.logits_tolerance is not None and self.logits_max_abs_diff <= self.logits_tolerance
        )
        return logits_ok and not (
            self.missing_in_dcp
            or self.unexpected_in_dcp
            or self.shape_mismatches
            or self.dtype_mismatches
            or self.value_mismatches
            or self.nonzero_expert_bias
        )

    def format(self) -> str:
        lines = [
            f"verify {self.hf_dir} against {self.dcp_dir}",
            f"  tensors compared bit for bit: {self.compared} ({self.compared_bytes / 1e9:.3f} GB)",
        ]

        def section(title: str, items: list, show) -> None:
            if items:
                lines.append(f"  {title}: {len(items)}")
                lines.extend(f"    {show(i)}" for i in items[:10])
                if len(items) > 10:
                    lines.append(f"    ... and {len(items) - 10} more")

        section("missing from the DCP", self.missing_in_dcp, str)
        section("in the DCP but not in the model", self.unexpected_in_dcp, str)
        section(
            "shape differs (HF-implied vs DCP)",
            self.shape_mismatches,
            lambda m: f"{m[0]}: {list(m[1])} vs {list(m[2])}",
        )
        section(
            "dtype differs (HF vs DCP)",
            self.dtype_mismatches,
            lambda m: f"{m[0]}: {m[1]} vs {m[2]}",
        )
        section(
            "values differ",
            self.value_mismatches,
            lambda d: (
                f"{d.name}: {d.differing} of {d.numel} elements, max |diff| {d.max_abs_diff:.3g}"
            ),
        )
        section("non-zero expert_bias_E (no HF counterpart)", self.nonzero_expert_bias, str)
        if self.logits_max_abs_diff is not None and not _finite(
            self.logits_max_abs_diff, self.logits_tolerance
        ):
            lines.append("  logits are NaN or Inf, so they cannot be compared:")
            if self.nonfinite_tensors:
                section("tensors holding NaN or Inf", self.nonfinite_tensors, str)
            else:
                lines.append("    no weight holds NaN or Inf: the models overflow on the prompt")
        elif self.logits_max_abs_diff is not None:
            lines.append(
                f"  logits max |diff| (HF vs torchtitan Qwen3): {self.logits_max_abs_diff:.3g} "
                f"(tolerance {self.logits_tolerance:.3g}: {RELATIVE_TOLERANCE:g} of the largest "
                "|logit|)"
            )
        lines.append("  result: " + ("identical" if self.ok else "DIFFERENT"))
        return "\n".join(lines)


def verify(
    hf_dir: str | os.PathLike, dcp_dir: str | os.PathLike, *, logits: bool = False
) -> VerifyReport:
    """Compare key sets, shapes, dtypes and every byte of the weights after the name mapping.

    With `logits=True` also run the HF model (transformers) and torchtitan's Qwen3 loaded from
    the DCP folder on a fixed prompt and record the largest logit difference (needs the
    `logits` extra). Reads stream one tensor at a time.
    """
    hf_dir, dcp_dir = Path(hf_dir), Path(dcp_dir)
    hf = HFFolder(hf_dir)
    config, config_file = read_config(hf_dir)
    layout = Qwen3Layout.from_config(config, config_file)
    layout.check_held(hf.shapes, config_file, hf_dir)
    check_hf_tensors(hf, layout, config_file)
    ckpt = dcp_read.DCPFolder(dcp_dir)
    report = VerifyReport(hf_dir, dcp_dir)
    comparable = _compare_names(report, layout.titan_tensors(), hf, ckpt)
    _compare_values(report, comparable, hf, ckpt, logits)
    if logits:
        from qwentitan.checkpoint.logits import compare_logits

        report.logits_max_abs_diff, report.logits_tolerance = compare_logits(
            hf_dir, dcp_dir, config
        )
    return report


def _compare_names(
    report: VerifyReport, tensors: list[TitanTensor], hf: HFFolder, ckpt: dcp_read.DCPFolder
) -> list[TitanTensor]:
    """Record missing and extra keys, shape and dtype mismatches; the tensors left to compare
    byte for byte."""
    expected = {t.name for t in tensors}
    model_keys = {k for k in ckpt.tensors if not k.startswith(NON_MODEL_PREFIXES)}
    # expert_bias_E may be absent: a model trained with load balancing off has none.
    report.missing_in_dcp = sorted({t.name for t in tensors if t.hf_names} - model_keys)
    report.unexpected_in_dcp = sorted(model_keys - expected)
    comparable = []
    for t in tensors:
        if t.name not in ckpt.tensors:
            continue
        shape, dtype = ckpt.tensors[t.name]
        want = hf.tensors[t.hf_names[0]].dtype if t.hf_names else torch.float32
        if shape != t.shape:
            report.shape_mismatches.append((t.name, t.shape, shape))
        elif dtype != want:
            report.dtype_mismatches.append((t.name, want, dtype))
        else:
            comparable.append(t)
    return comparable


def _compare_values(
    report: VerifyReport,
    comparable: list[TitanTensor],
    hf: HFFolder,
    ckpt: dcp_read.DCPFolder,
    logits: bool,
) -> None:
    """Compare every byte of `comparable`, a few tensors at a time within the memory budget."""
    budget = dcp_read.MemoryBudget(MEMORY_BUDGET)

    def compare(t: TitanTensor) -> None:
        nbytes = torch.empty(t.shape, dtype=ckpt.tensors[t.name][1], device="meta").nbytes
        with budget.hold(ckpt.load_cost(t.name) + nbytes):
            got = ckpt.load(t.name)
            if not t.hf_names:
                if got.any():
                    report.nonzero_expert_bias.append(t.name)
                return
            want = torch.empty_like(got)
            parts = want.unbind(0) if t.stacked else (want,)
            for name, part in zip(t.hf_names, parts, strict=True):
                read_into(hf.tensors[name], part)
            if logits and want.is_floating_point() and not bool(torch.isfinite(want).all()):
                report.nonfinite_tensors.append(t.name)
            difference = _difference(t.name, want, got)
            if difference is not None:
                report.value_mismatches.append(difference)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(compare, comparable))
    report.compared = len(comparable)
    report.compared_bytes = sum(
        torch.empty(t.shape, dtype=ckpt.tensors[t.name][1], device="meta").nbytes
        for t in comparable
    )
    report.value_mismatches.sort(key=lambda d: d.name)
    report.nonzero_expert_bias.sort()
    report.nonfinite_tensors.sort()


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _difference(name: str, want: torch.Tensor, got: torch.Tensor) -> ValueDifference | None:
    differing = differing_elements(want, got)
    if not differing:
        return None
    diff = (want.double() - got.double()).abs()
    return ValueDifference(
        name, differing, want.numel(), float(diff.nan_to_num(float("inf")).max())
    )
