"""`qwentitan-launch fetch`: download a recipe's model folder from the Hugging Face Hub.

Through huggingface_hub's `snapshot_download` into its cache (resumable, shared with
transformers; `HF_HOME` / `HF_HUB_CACHE` move it, `HF_TOKEN` authenticates, `HF_HUB_OFFLINE=1`
serves it from the cache alone), then linked (hard links, copies across file systems) into the
folder the recipe reads, through a temporary sibling renamed into place at the end: the folder
is either absent or whole. A `--dir` the user made and left empty is kept and filled instead
(through a hidden folder inside it), and left empty if the download fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.recipes import recipe_info, recipe_names

NAME = "fetch"
HELP = (
    "Download the Hugging Face model folder a recipe reads (weights, config, tokenizer; for "
    "qwen3_moe_kernels config and tokenizer only) into the recipe's folder, through the Hub cache."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help=f"one of {', '.join(recipe_names())}")
    parser.add_argument("--dir", type=Path, help="where to put it (default: the recipe's folder)")
    parser.add_argument("--revision", default="main", help="Hub branch, tag or commit")


def fetch_command(recipe: str) -> str:
    """The one command that downloads `recipe`'s model folder (for messages)."""
    return f"qwentitan-launch fetch --recipe {recipe}"


def recipe_folder(recipe: str) -> Path:
    """The model folder the recipe reads (its `hf_assets_path`, environment defaults applied)."""
    from qwentitan.launch.recipes import get_recipe

    return Path(get_recipe(recipe)().hf_assets_path).expanduser()


def fetch(
    repo_id: str, target: Path, *, patterns: tuple[str, ...] = (), revision: str = "main"
) -> int:
    """Put the Hub snapshot of `repo_id` at `target`; returns the number of files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from qwentitan.checkpoint.files import atomic_folder

    try:
        snapshot = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns) or None)
        )
    except (LocalEntryNotFoundError, HfHubHTTPError) as error:
        offline = env_defaults.hub_offline_set()
        why = (
            "HF_HUB_OFFLINE is set and the Hub cache lacks it" if offline else type(error).__name__
        )
        raise LaunchError(
            f"Could not download {repo_id} ({why}); check the network (and HF_TOKEN for a gated "
            "model), or copy the model folder to the host and pass its path."
        ) from None
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    if not files:
        raise LaunchError(f"The Hub snapshot of {repo_id} holds no files; check --revision.")
    if target.is_dir():
        _fill_kept(target, snapshot, files)
    else:
        with atomic_folder(target) as tmp:
            _link(snapshot, files, tmp)
    return len(files)


def _link(snapshot: Path, files: list[Path], folder: Path) -> None:
    for source in files:
        dest = folder / source.relative_to(snapshot)
        dest.parent.mkdir(parents=True, exist_ok=True)
        blob = source.resolve()  # the cache's snapshot entries are links to its blobs
        try:
            os.link(blob, dest)
        except OSError:
            shutil.copyfile(blob, dest)


def _fill_kept(target: Path, snapshot: Path, files: list[Path]) -> None:
    """Fill the user's own empty folder, which stays (its owner, mode, a mount there): through a
    hidden folder inside it, moved in at the end with config.json last, since config.json is
    what marks a whole model folder; on any failure the folder is left empty, as it was."""
    with tempfile.TemporaryDirectory(prefix=".qwentitan-fetch-", dir=target) as tmp:
        _link(snapshot, files, Path(tmp))
        entries = sorted(Path(tmp).iterdir(), key=lambda p: p.name == "config.json")
        try:
            for entry in entries:
                os.rename(entry, target / entry.name)
        except BaseException:
            for entry in entries:
                with contextlib.suppress(OSError):
                    os.rename(target / entry.name, entry)  # back out: removed with tmp
            raise


def run(args: argparse.Namespace) -> int:
    info = recipe_info(args.recipe)
    if info.hub_model is None:
        raise LaunchError(
            f"Recipe {args.recipe} needs no download (it builds its model and tokenizer here)."
        )
    target = (args.dir or recipe_folder(args.recipe)).absolute()
    if target.exists() and not target.is_dir():
        raise LaunchError(
            f"--dir {target} is a file; pass --dir naming a new or empty folder for the model."
        )
    if (target / "config.json").is_file():
        print(f"{target} already holds a model folder; remove it to fetch {info.hub_model} again.")
        return 0
    if target.exists() and any(target.iterdir()):
        raise LaunchError(
            f"{target} exists and is not a model folder; move it away or pass --dir elsewhere."
        )
    which = "config and tokenizer of " if info.hub_files else ""
    print(f"fetching {which}{info.hub_model} into {target}", flush=True)
    try:
        count = fetch(info.hub_model, target, patterns=info.hub_files, revision=args.revision)
    except OSError as error:
        raise LaunchError(
            f"Could not write {target} ({error.strerror or error}); free disk space or pass "
            "--dir on a writable disk with room."
        ) from None
    print(f"{count} files of {info.hub_model} in {target}")
    return 0
