"""What `qwentitan-launch train` costs over the bare torchrun line it runs, in the same run.

For `train --recipe tiny_dense --ranks 1 --steps 2`, and for the torchrun line (and plan
environment) that `plan --json` prints for the same run: the seconds from the start of the
command to the rank's step-1 line, and the resident memory of the process the user started
(the launcher, or torchrun itself) while the rank trains, sampled every 0.1 s. Goals: start ->
step 1 at most 1.2x the bare line's, and the launcher at most 250 MB. The two commands alternate
round by round so machine load hits them alike; medians of the rounds are printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROUNDS = 3
RUN = ["--recipe", "tiny_dense", "--ranks", "1", "--steps", "2"]
# The rank's step-1 line, coloured or not (torchtitan writes `\x1b[31mstep:  1  ...`).
STEP_1 = re.compile(r"(?<!validate )step:\s+1\s")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _measure(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the step-1 line, peak RSS in MB of the started process after that line)."""
    start = time.perf_counter()
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first_step = threading.Event()
    seen: list[str] = []

    def read() -> None:
        for line in process.stdout:
            seen.append(line)
            if not first_step.is_set() and STEP_1.search(COLOUR.sub("", line)):
                first_step.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not first_step.wait(0.05):
        if process.poll() is not None:
            reader.join()
            raise SystemExit(f"{argv[:3]} printed no step-1 line:\n{''.join(seen[-20:])}")
    to_step_1 = time.perf_counter() - start
    peak = 0
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    reader.join()
    if process.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({process.returncode}):\n{''.join(seen[-20:])}")
    return to_step_1, peak / 1e6


def main() -> None:
    launcher = shutil.which("qwentitan-launch")
    if launcher is None:
        raise SystemExit("qwentitan-launch is not installed here; run `uv sync`.")
    env = dict(os.environ, QWENTITAN_MLFLOW="off")
    times: dict[str, list[float]] = {"train": [], "torchrun": []}
    memory: dict[str, list[float]] = {"train": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="bench-launcher-") as tmp:
        for i in range(ROUNDS):
            train_dir, bare_dir = Path(tmp, f"train-{i}"), Path(tmp, f"bare-{i}")
            planned = json.loads(
                subprocess.run(
                    [launcher, "plan", *RUN, "--run-dir", str(bare_dir), "--json"],
                    env=env, capture_output=True, text=True, check=True,
                ).stdout
            )  # fmt: skip
            bare = [shutil.which("torchrun") or "torchrun", *planned["torchrun"][1:]]
            runs = {
                "train": ([launcher, "train", *RUN, "--run-dir", str(train_dir)], env),
                "torchrun": (bare, {**env, **planned["env"]}),
            }
            for name, (argv, run_env) in runs.items():
                seconds, mb = _measure(argv, run_env)
                times[name].append(seconds)
                memory[name].append(mb)
    step = {name: statistics.median(t) for name, t in times.items()}
    rss = {name: statistics.median(m) for name, m in memory.items()}
    print(f"launcher cost, median of {ROUNDS} alternating rounds ({' '.join(RUN)})")
    for name in times:
        print(f"  {name:<9} start -> step 1 {step[name]:6.1f} s   RSS of the started process "
              f"{rss[name]:6.0f} MB")  # fmt: skip
    print(f"start -> step 1, train / bare torchrun: {step['train'] / step['torchrun']:.2f}x "
          "(goal: <= 1.2x)")  # fmt: skip
    print(f"launcher RSS while its rank trains: {rss['train']:.0f} MB (goal: <= 250 MB)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
