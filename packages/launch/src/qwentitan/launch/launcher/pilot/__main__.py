"""`python -m qwentitan.launch.launcher.pilot`: the same as `qwentitan-launch pilot`."""

from __future__ import annotations

import sys

from qwentitan.launch.launcher.cli import main as launch


def main(argv: list[str] | None = None) -> int:
    return launch(["pilot", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
