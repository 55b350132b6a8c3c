"""Start-up cost of the commands a user types, against `python -c "import torch"` in the same run.

`qwentitan-launch --help` must build its parser without importing torch (the commands' heavy
modules load only when a command runs), so it should cost no more than importing torch. The
second pair shows what precompiled bytecode buys where `PYTHONDONTWRITEBYTECODE=1` is set (CI,
many containers): importing torchtitan's trainer with the environment's `.pyc` files versus with
them ignored (`-X pycache_prefix` pointed at an empty folder, so every module compiles from
source, as it would in an environment installed without `compile-bytecode`).
Commands alternate round by round so machine load hits them alike; medians are printed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = 5


def _seconds(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    launcher = shutil.which("qwentitan-launch")
    if launcher is None:
        raise SystemExit("qwentitan-launch is not installed here; run `uv sync --all-packages`.")
    with tempfile.TemporaryDirectory() as empty:
        commands = {
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "qwentitan-launch --help": [launcher, "--help"],
            "import torchtitan.train (.pyc)": [sys.executable, "-c", "import torchtitan.train"],
            "import torchtitan.train (no .pyc)": [
                sys.executable, "-X", f"pycache_prefix={empty}", "-c", "import torchtitan.train"
            ],
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(ROUNDS):
            for name, argv in commands.items():
                times[name].append(_seconds(argv, env))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"start-up, median of {ROUNDS} alternating rounds, PYTHONDONTWRITEBYTECODE=1")
    for name, seconds in median.items():
        print(f"  {name:<36} {seconds:7.2f} s")
    help_ratio = median["qwentitan-launch --help"] / median["python -c 'import torch'"]
    pyc_ratio = (
        median["import torchtitan.train (no .pyc)"] / median["import torchtitan.train (.pyc)"]
    )
    print(f"qwentitan-launch --help / import torch: {help_ratio:.2f}x (goal: <= 1)")
    print(f"import torchtitan.train, from source / from .pyc: {pyc_ratio:.2f}x")


if __name__ == "__main__":
    main()
