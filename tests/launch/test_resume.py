"""Two ranks train, stop, resume: the resumed steps equal those of an uninterrupted run. That run
also shows the Summary block `train` ends with, and one rank resumes it from an S3 run folder."""

import contextlib
import io
import math
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.slow

_STEP = re.compile(r"\bstep:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")
_VALIDATE = re.compile(r"validate step:\s+(\d+)\s+loss:\s+([0-9.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Small enough for a test: short windows, one sample per rank, validation every 2 steps.
_TINY = ["--ranks", "2", "--steps", "4", "--seq-len", "32", "--local-batch-size", "1",
         "--validate-every", "2"]  # fmt: skip


@dataclass(frozen=True)
class Trained:
    losses: dict[int, tuple[float, float]]  # step -> (loss, grad_norm)
    validation: dict[int, float]
    log: str  # what the ranks printed, as written
    launcher: str  # what the launcher itself printed (its sys.stdout)

    @property
    def plain(self) -> str:
        return _ANSI.sub("", self.log)


@pytest.fixture(scope="module")
def train(train_in_process, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")

    def run(run_dir, *extra):
        launcher = io.StringIO()
        with contextlib.redirect_stdout(launcher):
            code, log = train_in_process(
                [*_TINY, "--run-dir", str(run_dir), *extra],
                logs / f"{len(list(logs.iterdir()))}.log",
            )
        plain = _ANSI.sub("", log)
        assert code == 0, plain[-3000:]
        losses = {int(s): (float(loss), float(norm)) for s, loss, norm in _STEP.findall(plain)}
        validation = {int(s): float(loss) for s, loss in _VALIDATE.findall(plain)}
        return Trained(losses, validation, log, launcher.getvalue())

    return run


# Issue 56: lines a two-rank `train` leaves out of the console (regexes), all in its log.
LOG_ONLY = (
    r"^env +\S+=\S* +\(plan\)$",
    r"UserWarning: DTensor random operators may not have complete support on cpu device mesh",
    r"Preparing qwentitan-validation-\S+ dataset from offline",
    r" - INFO - \[GC\] ",
    r"Synchronizing and adjusting timeout",
)


def full_log(run_dir: Path) -> str:
    """Everything in RUN_DIR/logs: torchrun's files of every rank and attempt, the plan."""
    files = sorted(p for p in (run_dir / "logs").rglob("*") if p.suffix in (".log", ".txt"))
    assert files, f"no logs in {run_dir}"
    return "".join(p.read_text(errors="replace") for p in files)


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{i}")


def final_state(run_dir, step, tmp_path):
    """Every tensor of a DCP checkpoint (model and optimizer state), by dotted name."""
    out = tmp_path / f"{run_dir.name}-step{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoint" / f"step-{step}", out)
    return dict(_tensors(torch.load(out, weights_only=False)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, train):
    """Two ranks, 4 steps, a checkpoint every 2, each exported to Hugging Face (`--hf-every 2`),
    and MLflow on, into a store the run creates."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QWENTITAN_MLFLOW", "on")
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{run_dir / 'mlflow.db'}")
        return run_dir, train(run_dir / "run", "--checkpoint-interval", "2", "--hf-every", "2")


def test_two_ranks_train_with_validation_and_checkpoint(uninterrupted):
    root, run = uninterrupted
    losses = run.losses
    assert sorted(losses) == [1, 2, 3, 4]
    assert sorted(run.validation) == [1, 2, 4]  # torchtitan validates at step 1 and every freq
    assert "dp_shard=2" in run.log  # FSDP over both gloo ranks
    # a fresh model starts near ln(vocab) = ln(151936) ~ 11.93 and learns the repeated corpus
    assert losses[1][0] == pytest.approx(math.log(151936), abs=0.1)
    assert losses[4][0] < losses[2][0] < losses[1][0]
    for step in (2, 4):
        assert (root / "run" / "checkpoint" / f"step-{step}" / ".metadata").exists()


def test_train_ends_with_the_summary_and_without_the_noise(uninterrupted):
    """The block that ends every `train` (the launcher's own lines), from the metrics rank's
    report and MLflow run; none of the lines a user cannot act on in the ranks' log."""
    from mlflow import MlflowClient

    from .test_train_summary import NOISE, summary_rows

    root, run = uninterrupted
    for noise in NOISE:
        assert noise not in run.log, noise
    # Issue 56: lines left to the run's log (RUN_DIR/logs: every rank's whole output, the plan)
    logs = full_log(root / "run")
    for line in LOG_ONLY:
        assert re.search(line, logs, re.M), line
        assert not re.search(line, run.log + run.launcher, re.M), line
    assert "MFU: n/a on cpu" in run.log
    assert "Step 1 is the first: it compiles and warms up" in run.log
    (first_step,) = re.findall(r"First step 1: ([0-9.]+) s", run.log)
    launcher = run.launcher
    assert "qwentitan-launch train: starting the ranks" in launcher
    block = launcher.rstrip().splitlines()
    block = block[len(block) - 1 - block[::-1].index("Summary") :]
    assert all(line.startswith("  ") for line in block[1:])  # the block ends the console
    rows = summary_rows(launcher[launcher.rindex("Summary\n") :])
    losses = run.losses
    # the block's figures and the step lines are each rounded from the rank's own
    first, final = re.fullmatch(r"([0-9.]+) -> ([0-9.]+) \(step 1 -> 4\)", rows["loss"]).groups()
    assert float(first) == pytest.approx(losses[1][0], abs=2e-4)
    assert float(final) == pytest.approx(losses[4][0], abs=2e-4)
    validated, step = re.fullmatch(r"([0-9.]+) \(step (\d+)\)", rows["validation loss"]).groups()
    assert float(validated) == pytest.approx(run.validation[4], abs=2e-4) and step == "4"
    split = re.match(r"(\d+) in total = (\d+) per rank x (\d+) ", rows["tokens/s"])
    assert split and split[3] == "2" and int(split[2]) > 0
    assert abs(int(split[1]) - 2 * int(split[2])) <= 2  # each figure rounded on its own
    assert rows["warm-up"].startswith(f"{first_step} s")  # one figure: the rank's own line
    assert rows["checkpoints"] == str((root / "run" / "checkpoint").resolve())
    run_id = rows["MLflow run"].split()[0]
    uri = f"sqlite:///{root / 'mlflow.db'}"
    logged = MlflowClient(uri).get_run(run_id)
    assert logged.data.metrics["summary/first_loss"] == pytest.approx(losses[1][0], abs=1e-4)
    assert rows["serve the UI"] == f"uv run mlflow ui --backend-store-uri {uri}"
    assert f"/runs/{run_id}/model-metrics?" in rows["all charts"]
    assert f'"{run_id}"' in urllib.parse.unquote(rows["loss curve"])


def test_resume_continues_exactly(uninterrupted, train, tmp_path):
    """Two ranks resume the uninterrupted run's step-2 checkpoint, as a run stopped there leaves
    it (a stop that saves and ends: `--stop-after` in the one-rank test below), and continue it
    to the same losses, weights and optimizer moments."""
    root, reference = uninterrupted
    run_dir = tmp_path / "interrupted"
    step_2 = "checkpoint/step-2"
    shutil.copytree(root / "run" / step_2, run_dir / step_2)
    second = train(run_dir, "--resume")
    assert sorted(second.losses) == [3, 4] and "Training starts at step 3" in second.plain
    assert "lr_scheduler.py" in full_log(run_dir) and "lr_scheduler.py" not in second.log
    for step, (loss, grad_norm) in second.losses.items():
        assert loss == pytest.approx(reference.losses[step][0], abs=2e-5), step
        assert grad_norm == pytest.approx(reference.losses[step][1], abs=2e-4), step
    assert second.validation[4] == pytest.approx(reference.validation[4], abs=2e-4)
    # Weights and optimizer moments after the resumed run equal the uninterrupted run's.
    expected = final_state(root / "run", 4, tmp_path)
    resumed = final_state(run_dir, 4, tmp_path)
    assert expected.keys() == resumed.keys()
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in expected
    for key, tensor in expected.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_a_second_run_keeps_the_first_runs_checkpoint(uninterrupted, tmp_path, monkeypatch):
    """`nox -s train` twice: two run folders, both checkpoints kept, `--resume` takes the newest.
    Each run's ranks are stood in for by a copy of the uninterrupted run's checkpoints into the
    folder `train` hands them (`--dump-folder`), which is what real ranks write there: the
    uninterrupted run shows they do."""
    from qwentitan.launch.launcher import cli, supervisor

    saved = uninterrupted[0] / "run" / "checkpoint"
    launched = []

    def ranks(argv, env, **_):
        launched.append(folder := Path(argv[argv.index("--dump-folder") + 1]))
        shutil.copytree(saved, folder / "checkpoint", dirs_exist_ok=True)
        return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(supervisor, "supervise", ranks)
    tiny = ["--ranks", "1", "--steps", "4", "--seq-len", "32", "--local-batch-size", "1"]
    latest = tmp_path / "outputs" / "tiny_dense" / "latest"
    assert cli.main(["train", *tiny]) == 0
    first = latest.resolve()
    assert cli.main(["train", *tiny]) == 0
    second = latest.resolve()
    assert launched == [first, second] and second != first and second.parent == first.parent
    for folder in (first, second):
        assert (folder / "checkpoint" / "step-4" / ".metadata").is_file()
    assert cli.main(["train", *tiny[:2], "--steps", "5", "--resume"]) == 0
    assert launched[2] == second


def test_the_free_disk_estimate_is_within_5_percent_of_a_real_save(uninterrupted):
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.launcher.run_folder import checkpoint_bytes

    run_dir = uninterrupted[0] / "run"
    step = run_dir / "checkpoint" / "step-4"  # the last save: model, optimizer, data state
    export = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    saved = sum(f.stat().st_size for f in step.iterdir() if f.is_file() and f.name not in export)
    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=2, seq_len=32, local_batch_size=1, steps=4, run_dir=str(run_dir)))  # fmt: skip
    assert abs(checkpoint_bytes(plan) / saved - 1) < 0.05, (checkpoint_bytes(plan), saved)


def test_one_rank_resumes_the_two_rank_checkpoint_from_s3_on_the_same_curve(
    uninterrupted, train, s3, tmp_path, monkeypatch
):
    """Every mesh, one curve, and a run folder on S3 (`--run-dir s3://...`, moto's server on
    loopback): one rank resumes the two ranks' step-2 checkpoint from the bucket (each tensor
    resharded from two shards to one, its `.metadata` read by the allow-list reader before any
    rank loads it) and trains the same windows in step 3's global batch (2 samples: 2 ranks x 1
    there, 1 rank x 2 microbatches here), so its loss is the two ranks' to float tolerance;
    `--stop-after 3` then saves into the bucket and ends the run before its last step. Logs and
    reports stay in the run's local folder. With `--hf-every 2` the resumed run exports the
    step-2 checkpoint it found unexported and its own last one, step 3, into the bucket's
    `hf/`: each a verified Hugging Face folder that transformers loads, with the checkpoint's
    logits. On S3 an export is uploaded to a hidden prefix and copied into hf/step-N with
    config.json last: what a killed export left there (a hidden upload, a step-N cut short
    without config.json) is removed before the next export, which lands whole. (One rank from
    scratch against more ranks: the mesh pilot in tests/launch/test_every_mesh.py.)"""
    from qwentitan.checkpoint import safe_reader_for
    from qwentitan.launch.launcher import remote
    from qwentitan.launch.runtime.hf_export import HFExports

    from .conftest import BUCKET
    from .test_train_summary import summary_rows

    root, reference = uninterrupted
    monkeypatch.chdir(tmp_path)  # the run's local folder: outputs/s3/BUCKET/one-rank
    s3.put(str(root / "run" / "checkpoint" / "step-2"), f"{BUCKET}/one-rank/checkpoint/step-2",
           recursive=True)  # fmt: skip
    assert s3.isfile(f"{BUCKET}/one-rank/checkpoint/step-2/.metadata")
    hf = f"{BUCKET}/one-rank/hf"
    s3.pipe(
        {
            f"{hf}/.step-2.upload-99/model.safetensors": b"partial",
            f"{hf}/step-2/model.safetensors": b"cut short",
        }
    )  # what a killed export left
    run_dir = f"s3://{BUCKET}/one-rank"
    pinned = ["--global-batch-size", "2"]
    resumed = train(
        run_dir, "--ranks", "1", "--resume", "--stop-after", "3", "--hf-every", "2", *pinned
    )
    assert "no free-space check for s3://" in resumed.launcher
    for noise in ("Found credentials in", "Found endpoint for s3"):  # botocore's INFO lines
        assert noise not in resumed.plain, noise
    assert "dp_shard=1" in resumed.plain and "Training starts at step 3" in resumed.plain
    assert sorted(resumed.losses) == [3] and "Stopping after step 3" in resumed.plain
    for finished in ("at last step", "Last step checkpoint", "Training completed"):  # issue 56
        assert finished not in resumed.plain, finished
    assert resumed.losses[3][0] == pytest.approx(reference.losses[3][0], abs=1e-4)
    listed = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/one-rank/checkpoint"))
    assert listed == ["step-2", "step-3"]
    metadata = safe_reader_for(f"{run_dir}/checkpoint/step-3").read_metadata()
    assert "tok_embeddings.weight" in metadata.state_dict_metadata
    local = remote.local_folder(run_dir)  # outputs/s3/BUCKET/one-rank-HASH, in tmp_path
    assert local.parent == tmp_path / "outputs" / "s3" / BUCKET
    assert (local / "reports" / "summary.json").is_file()
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(hf)) == ["step-2", "step-3"]  # no leftover
    names = {p.rsplit("/", 1)[-1] for p in s3.find(f"{hf}/step-2")}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names
    assert (
        s3.cat(f"{hf}/step-2/model.safetensors")
        == (root / "run" / "hf" / "step-2" / "model.safetensors").read_bytes()
    )  # the same bytes as the local run's export of the same checkpoint
    assert f"Exported step 3 to {run_dir}/hf/step-3 (verified)." in resumed.plain
    rows = summary_rows(resumed.launcher[resumed.launcher.rindex("Summary\n") :])
    assert rows["HF export"] == f"{run_dir}/hf/step-3 (verified)"
    s3.get(f"{hf}/step-3", str(tmp_path / "hf-step-3"), recursive=True)
    s3.get(f"{BUCKET}/one-rank/checkpoint/step-3", str(tmp_path / "step-3"), recursive=True)
    _loads_with_the_checkpoints_logits(tmp_path / "hf-step-3", tmp_path / "step-3")
    again = HFExports(f"{run_dir}/checkpoint", run_dir, every=2, keep=1)
    again.submit_missing()  # a complete export is never redone
    assert not again.queue and again.proc is None
    # An export another process lands is seen, though this process listed hf/ before it did
    # (s3fs keeps listings): --hf-keep 1 then keeps it, the newest, alone.
    assert [p.rsplit("/", 1)[-1] for p in again.fs.ls(again.hf)] == ["step-2", "step-3"]
    s3.pipe(f"{hf}/step-4/config.json", b"{}")
    again._prune()
    assert [p.rsplit("/", 1)[-1] for p in s3.ls(hf, refresh=True)] == ["step-4"]


def test_each_checkpoint_exports_itself_to_a_verified_hugging_face_folder(uninterrupted):
    """`--hf-every 2`: hf/step-2 and hf/step-4 beside the checkpoints, written by a process of
    rank 0's while training went on; each loads with transformers (model and tokenizer) and its
    logits on a fixed prompt equal torchtitan's Qwen3 loaded from the checkpoint. The checkpoint
    itself carries config and tokenizer, so it exports with no --config."""
    from mlflow import MlflowClient

    from .test_train_summary import summary_rows

    root, run = uninterrupted
    run_dir = root / "run"
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-2", "step-4"]
    for step in (2, 4):
        ckpt, hf = run_dir / "checkpoint" / f"step-{step}", run_dir / "hf" / f"step-{step}"
        for name in ("config.json", "generation_config.json", "tokenizer.json"):
            assert (ckpt / name).is_file() and (hf / name).is_file(), name
        assert f"Exported step {step} to {hf.resolve()} (verified)." in run.plain
        _loads_with_the_checkpoints_logits(hf, ckpt)
    rows = summary_rows(run.launcher[run.launcher.rindex("Summary\n") :])
    assert rows["HF export"] == f"{(run_dir / 'hf' / 'step-4').resolve()} (verified)"
    run_id = rows["MLflow run"].split()[0]
    tags = MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["hf_export.last"].startswith("step 4 ok: ")


def _loads_with_the_checkpoints_logits(hf, ckpt):
    """The export `hf` loads with transformers (model and tokenizer) and its logits on a fixed
    prompt equal torchtitan's Qwen3 loaded from the checkpoint `ckpt`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwentitan.checkpoint import verify

    model = AutoModelForCausalLM.from_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 151936)
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 151643
    report = verify(hf, ckpt, logits=True)
    assert report.ok and report.compared > 0, report.format()
    assert report.logits_max_abs_diff <= report.logits_tolerance, report.format()


def test_a_killed_export_leaves_nothing_half_and_the_next_lands(uninterrupted, tmp_path):
    """SIGKILL of the export process mid-write: no hf/step-2 folder, its partial gone when the
    next export starts, which lands; `--resume` (a new exporter on the folder) exports what was
    left; `--hf-keep 1` keeps the newest export and every checkpoint."""
    import os
    import signal
    import time

    from qwentitan.launch.runtime.hf_export import HFExports

    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0] / "run" / "checkpoint", run_dir / "checkpoint")
    results = []
    exports = HFExports(
        str(run_dir / "checkpoint"), str(run_dir), every=2, on_result=results.append
    )
    exports.submit(2)
    hf = run_dir / "hf"
    deadline = time.monotonic() + 120
    while not any(hf.rglob("model.safetensors")):  # to_hf laid out the shard: mid-write
        assert exports.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(exports.proc.pid, signal.SIGKILL)
    exports.proc.wait()
    exports.poll()
    assert results[-1]["ok"] is False and results[-1]["step"] == 2
    assert not (hf / "step-2").exists() and not any(hf.glob("step-*"))
    exports.submit(4)
    exports.close(timeout_s=300)
    assert results[-1] == {**results[-1], "step": 4, "ok": True}
    assert sorted(p.name for p in hf.iterdir()) == ["step-4"]  # the killed one's partial: gone
    resumed = HFExports(str(run_dir / "checkpoint"), str(run_dir), every=2, keep=1)
    resumed.submit_missing()
    assert not resumed.queue and resumed.proc is None  # step-2 is not among the newest 1
    resumed = HFExports(str(run_dir / "checkpoint"), str(run_dir), every=2)
    resumed.submit_missing()
    resumed.close(timeout_s=300)
    assert sorted(p.name for p in hf.iterdir()) == ["step-2", "step-4"]
    shutil.rmtree(hf / "step-2")
    stopping = HFExports(str(run_dir / "checkpoint"), str(run_dir), every=2)
    stopping.submit(2)
    stopping.close(timeout_s=0)  # a signal's stop: the export in flight is abandoned, whole
    assert stopping.last["ok"] is False and "abandoned" in stopping.last["error"]
    assert sorted(p.name for p in hf.iterdir()) == ["step-4"]
    resumed.submit(2)
    resumed.close(timeout_s=300)
    kept = HFExports(str(run_dir / "checkpoint"), str(run_dir), every=2, keep=1)
    kept._prune()
    assert sorted(p.name for p in hf.iterdir()) == ["step-4"]
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-2", "step-4"]
