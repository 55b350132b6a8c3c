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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["HFExports", "export_files", "write_export_files"]

HF_FOLDER = "hf"
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


class HFExports:
    """Exports of a run's checkpoints to `run_dir/hf/step-N`, one process at a time (rank 0)."""

    def __init__(
        self,
        checkpoint_folder: str,
        run_dir: str,
        *,
        every: int,
        keep: int = 0,
        on_result: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.checkpoints = Path(checkpoint_folder)
        self.hf = Path(run_dir) / HF_FOLDER
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
        if not self.checkpoints.is_dir():
            return
        steps = sorted(
            s
            for p in self.checkpoints.iterdir()
            if (s := _step(p.name)) is not None and (p / ".metadata").is_file()
        )
        wanted = [s for s in steps if s % self.every == 0 or s == steps[-1]]
        for step in wanted[-self.keep :] if self.keep > 0 else wanted:  # what --hf-keep keeps
            if not (self.hf / f"step-{step}").is_dir():
                self.submit(step)

    def poll(self) -> None:
        """Collect a finished export; start the next queued one."""
        if self.proc is not None and self.proc.poll() is not None:
            self._finish()
        if self.proc is None and self.queue:
            self._start(self.queue.popleft())

    def _start(self, step: int) -> None:
        self.hf.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        log = self.hf / f".export-step-{step}.log"
        command = [sys.executable, "-m", __name__]
        command += [str(self.checkpoints / f"step-{step}"), str(self.hf / f"step-{step}")]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a stop kills it whole
            )
        self.current = (step, time.monotonic(), log)

    def _finish(self, abandoned: str | None = None) -> None:
        assert self.proc is not None and self.current is not None
        step, started, log = self.current
        code = self.proc.returncode
        text = log.read_text(errors="replace").strip() if log.is_file() else ""
        log.unlink(missing_ok=True)
        folder = self.hf / f"step-{step}"
        ok = abandoned is None and code == 0 and folder.is_dir()
        if ok:
            error = None
        elif abandoned is not None:
            error = abandoned
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            error = lines[-1] if lines else f"the export process ended with code {code}"
        self.proc, self.current = None, None
        if not ok:
            self._remove_leftovers()
        self.last = {
            "step": step,
            "folder": str(folder),
            "ok": ok,
            "seconds": round(time.monotonic() - started, 2),
            **({"error": error} if error else {}),
        }
        if ok:
            self._prune()
        if self.on_result is not None:
            self.on_result(self.last)

    def _remove_leftovers(self) -> None:
        """Hidden partial folders a killed export left (to_hf's temporary siblings, an
        unverified export): only one export runs at a time, and none does now."""
        for path in self.hf.iterdir():
            if path.name.startswith(".") and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest `keep` exports (0: all); checkpoints are never touched."""
        if self.keep <= 0:
            return
        exports = sorted(
            (s, p) for p in self.hf.iterdir() if (s := _step(p.name)) is not None and p.is_dir()
        )
        for _, path in exports[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

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


def main(argv: list[str] | None = None) -> int:
    """`python -m qwentitan.launch.runtime.hf_export STEP_DIR OUT_DIR`: export, verify, rename."""
    from qwentitan.checkpoint import CheckpointError, to_hf, verify

    step_dir, out_dir = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    if out_dir.is_dir():
        print(f"{out_dir} exists already; kept as it is", flush=True)
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
