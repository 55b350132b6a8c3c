"""What `--hf-every` costs training: steps/s with and without it, in the same run.

`train --recipe tiny_dense --ranks 1 --steps 8 --checkpoint-interval 2`, once as it is and once
with `--hf-every 2` (each checkpoint exported and verified by a process beside the rank, which
shares the machine's cores with it). Steps/s from the rank's own step lines, from step 2 to the
last (the first step compiles); the two runs alternate round by round so machine load hits them
alike, and the medians are compared. Goal: the ratio within the noise of 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

RUN = ["--recipe", "tiny_dense", "--ranks", "1", "--steps", "8", "--checkpoint-interval", "2"]
# torchtitan's step line with its log time: `[titan] 2026-12-07 01:49:27,565 - ... step:  2  loss`
STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - .*?(?<!validate )step:\s+(\d+)\s+loss")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def steps_per_second(log: str) -> float:
    """Steps/s between the step-2 line and the last step line of a rank's log."""
    times = {
        int(step): datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
        for stamp, step in STEP.findall(COLOUR.sub("", log))
    }
    last = max(times)
    return (last - 2) / (times[last] - times[2]).total_seconds()


def _train(launcher: str, run_dir: Path, extra: list[str]) -> float:
    env = dict(os.environ, QWENTITAN_MLFLOW="off")
    argv = [launcher, "train", *RUN, "--run-dir", str(run_dir), *extra]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return steps_per_second(done.stdout + done.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (default 1)")
    args, _ = parser.parse_known_args()  # `nox -s bench` passes every script the same options
    launcher = shutil.which("qwentitan-launch")
    if launcher is None:
        raise SystemExit("qwentitan-launch is not installed here; run `uv sync`.")
    rates: dict[str, list[float]] = {"without": [], "with --hf-every 2": []}
    with tempfile.TemporaryDirectory(prefix="bench-hf-export-") as tmp:
        for i in range(args.rounds):
            rates["without"].append(_train(launcher, Path(tmp, f"plain-{i}"), []))
            exported = Path(tmp, f"hf-{i}")
            rates["with --hf-every 2"].append(_train(launcher, exported, ["--hf-every", "2"]))
            landed = sorted(p.name for p in (exported / "hf").iterdir())
            if landed != ["step-2", "step-4", "step-6", "step-8"]:
                raise SystemExit(f"--hf-every 2 exported {landed}, not steps 2, 4, 6 and 8")
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(f"--hf-every cost, median of {args.rounds} alternating round(s) ({' '.join(RUN)})")
    for name, rate in median.items():
        each = ", ".join(f"{r:.3f}" for r in rates[name])
        print(f"  {name:<18} {rate:6.3f} steps/s (steps 2 -> 8; each round: {each})")
    ratio = median["with --hf-every 2"] / median["without"]
    print(f"steps/s with / without --hf-every: {ratio:.2f}x (goal: within the noise of 1)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
