"""A preflight report: one line per check, pass / fail / skip, with the figures it measured."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# "warn": the run can go ahead, but something costs time or money (not a failure).
Status = Literal["pass", "warn", "fail", "skip"]


@dataclass(slots=True)
class CheckResult:
    """The outcome of one check; `detail` says what was found (or why it was skipped)."""

    name: str
    status: Status
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PreflightReport:
    recipe: str
    instance: str
    host: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    @property
    def warned(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "warn"]

    @property
    def skipped(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "skip"]

    def get(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "instance": self.instance,
            "host": self.host,
            "passed": self.passed,
            "failed": self.failed,
            "warned": self.warned,
            "skipped": self.skipped,
            "checks": [asdict(c) for c in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def render(self) -> str:
        width = max(len(c.name) for c in self.checks) if self.checks else 0
        lines = [f"preflight  recipe {self.recipe} on {self.instance} (this host: {self.host})"]
        for c in self.checks:
            lines.append(f"  {c.status.upper():4}  {c.name:{width}}  {c.detail}")
        verdict = "PASSED" if self.passed else f"FAILED: {', '.join(self.failed)}"
        skipped = (
            f" ({len(self.skipped)} skipped: {', '.join(self.skipped)})" if self.skipped else ""
        )
        warned = f" ({len(self.warned)} warned: {', '.join(self.warned)})" if self.warned else ""
        lines.append(f"preflight {verdict}{warned}{skipped}")
        return "\n".join(lines)

    def log_to_mlflow(self, tracking_uri: str | None = None, run_id: str | None = None) -> str:
        """Attach the report to an MLflow run (the given one, else a new `preflight` run)."""
        import mlflow

        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        with mlflow.start_run(
            run_id=run_id, run_name=None if run_id else f"preflight-{self.recipe}"
        ) as run:
            mlflow.log_dict(self.to_dict(), "preflight/report.json")
            mlflow.log_text(self.render(), "preflight/report.txt")
            mlflow.set_tag("preflight", "passed" if self.passed else "failed")
            mlflow.log_metric("preflight_failed_checks", len(self.failed))
            return run.info.run_id
