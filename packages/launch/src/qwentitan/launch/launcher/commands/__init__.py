"""Subcommands of `qwentitan-launch`, one module each (see `qwentitan.launch.launcher.cli`)."""
