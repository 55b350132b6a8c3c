"""Hugging Face out of a running job: what each checkpoint carries for export, and the exports.

- `export_files` / `write_export_files`: every `RUN/checkpoint/step-N` gets the Hugging Face
  `config.json` of the run's flavor, a `generation_config.json` and the tokenizer's files, so
  `qwentitan-ckpt to-hf RUN/checkpoint/step-N OUT` needs no `--config` (rank 0 writes them
  after the save landed; small files, each replaced atomically).
- `HFExports` (rank 0, `--hf-every N`): exports checkpoints to `RUN/hf/step-N` one at a time, each
  in a process of its own (`python -m qwentitan.launch.runtime.hf_export STEP OUT`): the
  streaming `qwentitan.checkpoint.to_hf`, then `verify` bit for bit, then a rename. No rank holds
  a state dict for it; a failed export is one line (and the `on_result` callback's tag) and
  training goes on. A stop waits a bounded time, then kills the export's process group: what it
  left is a hidden sibling, removed before the next export.

On S3 (`--run-dir s3://...`) the export process downloads the step folder to a local temporary
folder, exports and verifies it there, uploads it to a hidden sibling prefix and copies it into
`hf/step-N` with `config.json` last (S3 has no rename): a `step-N` without `config.json` is a
copy cut short, removed like a hidden sibling before that step is exported again. Every export,
local or on S3, is complete when its `config.json` is there.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["HFExports", "export_files", "write_export_files"]

HF_FOLDER = "hf"
# What makes an export complete: written last (to S3), present in every Hugging Face folder.
COMPLETE = "config.json"
_STEP = re.compile(r"step-(\d+)")


def export_files(flavor: str, hf_assets_path: str | os.PathLike | None) -> dict[str, bytes]:
    """The files a checkpoint of `flavor` carries for export: config, generation config and the
    tokenizer files found in `hf_assets_path`."""
    from qwentitan.checkpoint.convert import TOKENIZER_FILES
    from qwentitan.modeling import flavor_to_hf_config

    config = flavor_to_hf_config(flavor).to_dict()
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {k: config[k] for k in keys if config.get(k) is not None}
    files: dict[str, bytes] = {}
    if hf_assets_path:
        for name in TOKENIZER_FILES:
            path = Path(hf_assets_path) / name
            if path.is_file():
                files[name] = path.read_bytes()
    if "eos_token_id" not in generation and "tokenizer.json" in files:
        generation |= _end_of_text(files)  # generation stops where the tokenizer's text ends
    files["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    files["generation_config.json"] = (json.dumps(generation, indent=2) + "\n").encode()
    return files


def _end_of_text(files: dict[str, bytes]) -> dict[str, int]:
    """The eos (and pad) token ids that the tokenizer's config names, looked up in its vocabulary."""
    try:
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        added = json.loads(files["tokenizer.json"]).get("added_tokens", [])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return {}
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    found = {}
    for key in ("eos_token", "pad_token"):
        token = config.get(key) if isinstance(config, dict) else None
        if isinstance(token, str) and isinstance(ids.get(token), int):
            found[f"{key}_id"] = ids[token]
    return found


def write_export_files(step_folder: str, files: dict[str, bytes]) -> None:
    """Put `files` into a checkpoint's step folder (a path, or an fsspec URL such as s3://)."""
    if "://" in step_folder:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(step_folder)
        for name, data in files.items():
            fs.pipe_file(f"{root}/{name}", data)  # an object appears whole
        return
    from qwentitan.checkpoint.files import atomic_file

    folder = Path(step_folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        with atomic_file(folder / name) as tmp:
            tmp.write_bytes(data)
            tmp.chmod(0o644)  # as the checkpoint's own files (mkstemp makes it 0600)


def _step(name: str) -> int | None:
    match = _STEP.fullmatch(name)
    return int(match[1]) if match else None


def _fs(folder: str) -> Any:
    """The fsspec filesystem of `folder` (a local path, or an URL such as s3://)."""
    from fsspec.core import url_to_fs

    return url_to_fs(folder)[0]


def _names(fs: Any, folder: str) -> list[str]:
    """The names directly in `folder` (none when it is not there), as it is now: s3fs answers
    from its listing cache, shared by the process, which knows nothing of what the export
    process (or the ranks) wrote since."""
    fs.invalidate_cache(folder)
    try:
        return [path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return []


class HFExports:
    """Exports of a run's checkpoints to `run_dir/hf/step-N`, one process at a time (rank 0).
    `checkpoint_folder` and `run_dir` are local paths or URLs (s3://)."""

    def __init__(
        self,
        checkpoint_folder: str,
        run_dir: str,
        *,
        every: int,
        keep: int = 0,
        on_result: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.checkpoints = str(checkpoint_folder).rstrip("/")
        self.hf = f"{str(run_dir).rstrip('/')}/{HF_FOLDER}"
        self.fs = _fs(self.hf)
        self.every, self.keep = every, keep
        self.on_result = on_result
        self.queue: collections.deque[int] = collections.deque()
        self.proc: subprocess.Popen | None = None
        self.current: tuple[int, float, Path] | None = None  # step, start time, log file
        self.last: dict[str, Any] | None = None

    def wanted(self, step: int, last: bool) -> bool:
        return last or step % self.every == 0

    def submit(self, step: int) -> None:
        """Queue the export of checkpoint `step` (which has landed)."""
        if step not in self.queue and (self.current is None or self.current[0] != step):
            self.queue.append(step)
        self.poll()

    def submit_missing(self) -> None:
        """On resume: queue the checkpoints that should have been exported but were not (an
        earlier run stopped first): those at a multiple of `every`, and the newest."""
        fs = _fs(self.checkpoints)
        steps = sorted(
            s
            for name in _names(fs, self.checkpoints)
            if (s := _step(name)) is not None
            and ".metadata" in _names(fs, f"{self.checkpoints}/step-{s}")
        )
        wanted = [s for s in steps if s % self.every == 0 or s == steps[-1]]
        for step in wanted[-self.keep :] if self.keep > 0 else wanted:  # what --hf-keep keeps
            if not self._complete(step):
                self.submit(step)

    def poll(self) -> None:
        """Collect a finished export; start the next queued one."""
        if self.proc is not None and self.proc.poll() is not None:
            self._finish()
        if self.proc is None and self.queue:
            self._start(self.queue.popleft())

    def _folder(self, step: int) -> str:
        return f"{self.hf}/step-{step}"

    def _complete(self, step: int) -> bool:
        self.fs.invalidate_cache(self._folder(step))  # see `_names`
        return self.fs.isfile(f"{self._folder(step)}/{COMPLETE}")

    def _start(self, step: int) -> None:
        self.fs.makedirs(self.hf, exist_ok=True)
        self._remove_leftovers(step)
        handle, name = tempfile.mkstemp(prefix=f"qwentitan-export-step-{step}-", suffix=".log")
        command = [sys.executable, "-m", __name__]
        command += [f"{self.checkpoints}/step-{step}", self._folder(step)]
        with os.fdopen(handle, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a stop kills it whole
            )
        self.current = (step, time.monotonic(), Path(name))

    def _finish(self, abandoned: str | None = None) -> None:
        assert self.proc is not None and self.current is not None
        step, started, log = self.current
        code = self.proc.returncode
        text = log.read_text(errors="replace").strip() if log.is_file() else ""
        log.unlink(missing_ok=True)
        ok = abandoned is None and code == 0 and self._complete(step)
        if ok:
            error = None
        elif abandoned is not None:
            error = abandoned
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            error = lines[-1] if lines else f"the export process ended with code {code}"
        self.proc, self.current = None, None
        if not ok:
            self._remove_leftovers(step)
        self.last = {
            "step": step,
            "folder": self._folder(step),
            "ok": ok,
            "seconds": round(time.monotonic() - started, 2),
            **({"error": error} if error else {}),
        }
        if ok:
            self._prune()
        if self.on_result is not None:
            self.on_result(self.last)

    def _remove_leftovers(self, step: int) -> None:
        """What a killed export left: hidden partial folders (to_hf's temporary siblings, an
        unverified export, an S3 upload) and the `step-N` of `step` if its copy into place was
        cut short (only that one is checked: one request, not one per export, between two
        steps of rank 0). Only one export runs at a time, and none does now."""
        names = [n for n in _names(self.fs, self.hf) if n.startswith(".")]
        if not self._complete(step):
            names.append(f"step-{step}")
        for name in names:
            path = f"{self.hf}/{name}"
            if self.fs.isdir(path):
                with contextlib.suppress(OSError):  # a link placed there is not followed
                    self.fs.rm(path, recursive=True)

    def _prune(self) -> None:
        """Keep the newest `keep` exports (0: all); checkpoints are never touched."""
        if self.keep <= 0:
            return
        exports = sorted(s for n in _names(self.fs, self.hf) if (s := _step(n)) is not None)
        for step in exports[: -self.keep]:
            with contextlib.suppress(OSError):
                self.fs.rm(self._folder(step), recursive=True)

    def close(self, timeout_s: float) -> None:
        """Finish the queued exports within `timeout_s`, then abandon what is left: the
        export in flight is killed with its process group, its partial folder removed."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while self.proc is not None:
            left = deadline - time.monotonic()
            try:
                self.proc.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self._finish(abandoned=f"abandoned after {timeout_s:g} s at the stop")
                break
            self.poll()
        self.queue.clear()  # what was not started: `--resume` exports it


def export(step_dir: Path, out_dir: Path) -> int:
    """Export the local checkpoint `step_dir` to `out_dir`, verify it, then rename it into
    place; 0, or 1 after one line saying why."""
    from qwentitan.checkpoint import CheckpointError, to_hf, verify

    unverified = out_dir.parent / f".{out_dir.name}.unverified-{os.getpid()}"
    try:
        to_hf(step_dir, unverified)
        report = verify(unverified, step_dir)
    except CheckpointError as error:
        shutil.rmtree(unverified, ignore_errors=True)
        print(f"export of {step_dir} failed: {error}", flush=True)
        return 1
    if not report.ok:
        shutil.rmtree(unverified, ignore_errors=True)
        print(f"export of {step_dir} differs from the checkpoint: {report.format()}", flush=True)
        return 1
    os.rename(unverified, out_dir)
    print(f"exported {step_dir} to {out_dir} ({report.compared} tensors verified)", flush=True)
    return 0


def export_remote(step_url: str, out_url: str) -> int:
    """`export` for a step folder and an export on S3: through a local temporary folder, then
    uploaded to a hidden sibling and copied into `out_url`, COMPLETE last."""
    from fsspec.core import url_to_fs

    from qwentitan.launch.base import s3

    s3.apply_deadlines()
    fs, step_root = url_to_fs(step_url)
    parent, name = out_url.rstrip("/").rsplit("/", 1)
    hidden = f"{parent}/.{name}.upload-{os.getpid()}"
    try:
        with tempfile.TemporaryDirectory(prefix="qwentitan-hf-export-") as tmp:
            local_step, local_out = Path(tmp, "checkpoint"), Path(tmp, "hf")
            for path in fs.find(step_root):  # the step folder's objects, nothing around them
                local = local_step / path[len(step_root) :].lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(path, str(local))
            if code := export(local_step, local_out):
                return code
            files = sorted(
                (p.relative_to(local_out).as_posix() for p in local_out.rglob("*") if p.is_file()),
                key=lambda file: (file == COMPLETE, file),  # the marker last
            )
            for file in files:
                fs.put_file(str(local_out / file), f"{hidden}/{file}")
            for file in files:
                fs.copy(f"{hidden}/{file}", f"{out_url}/{file}")
    except Exception as error:  # S3 unanswered, no credentials, a full local disk: one line
        said = s3.failure(out_url, error) or f"{type(error).__name__}: {error}"
        print(f"export of {step_url} to {out_url} failed: {said}", flush=True)
        return 1
    finally:
        with contextlib.suppress(Exception):  # what is left, the next export removes
            fs.rm(hidden, recursive=True)
    print(f"uploaded the export to {out_url}", flush=True)
    return 0


def _background() -> None:
    """Yield the cores to the ranks: the lowest CPU priority (nice 19) and one torch thread, so
    the export runs on what the ranks leave of the host's cores (`nox -s bench -- hf_export`
    measures what it still costs them)."""
    with contextlib.suppress(OSError):
        os.nice(19)
    import torch

    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    """`python -m qwentitan.launch.runtime.hf_export STEP_DIR OUT_DIR`: export, verify, rename
    (paths, or s3:// URLs)."""
    step_dir, out_dir = argv if argv is not None else sys.argv[1:]
    _background()
    if _fs(out_dir).isfile(f"{out_dir}/{COMPLETE}"):
        print(f"{out_dir} exists already; kept as it is", flush=True)
        return 0
    if "://" in out_dir:
        return export_remote(step_dir, out_dir)
    return export(Path(step_dir), Path(out_dir))


if __name__ == "__main__":
    sys.exit(main())
