"""qwentitan-ckpt to-dcp / to-hf against `cp` + sync and against torchtitan's own route.

Generates, tensor by tensor, Hub-style sharded bf16 checkpoints with Qwen3-1.7B's shapes
(~3.4 GB) and Qwen3-30B-A3B's shapes cut to 4 layers (~6 GB) in a temporary folder, then
times, one at a time, each in its own child process (peak RSS = the child's VmHWM, read in
the child: ru_maxrss would report the parent's peak, which exec carries over):

- `cp -r` of the HF folder followed by `sync`: the disk's own speed, the baseline;
- `to_dcp` and `to_hf` (conversion time measured inside the child, without interpreter start);
- torchtitan's route, last: its Qwen3StateDictAdapter with DCP's HuggingFaceStorageReader into
  a float32 model state dict, `dcp.save`; back with HuggingFaceStorageWriter + consolidation.
  It needs 12-22 GiB of RAM, so it runs only with enough memory available (or never with
  --skip-torchtitan).

The first three are timed in interleaved rounds (cp, to-dcp, to-hf, cp, ...) on this shared
disk, so a slow spell hits all of them alike; the table shows each one's median and fastest
round. Right before each timed step (in the child: after its imports) the page cache is flushed
and, when run as root, dropped (see `settle`).

Run: `uv run nox -s bench -- checkpoint` or `uv run python benchmarks/bench_checkpoint.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
SHAPES = {
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen3-30b-a3b-4layers": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # For trying the script quickly; not part of the default run.
    "tiny": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 128,
        "torch_dtype": "bfloat16",
    },
}
# Peak RSS torchtitan's route reached on this kind of machine (see issue 6), plus headroom.
TORCHTITAN_NEEDS = {"qwen3-1.7b": 18 * GiB, "qwen3-30b-a3b-4layers": 26 * GiB, "tiny": 1 * GiB}


def generate(folder: Path, config: dict, shard_bytes: int = 2 * 10**9) -> int:
    """A Hub-style sharded bf16 folder, written one random tensor at a time; returns its bytes."""
    import torch

    from qwentitan.checkpoint.layout import Qwen3Layout
    from qwentitan.checkpoint.safetensors_io import ShardedWriter

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    shapes = Qwen3Layout.from_config(config, "bench").hf_shapes()
    writer = ShardedWriter(folder, [(n, torch.bfloat16, s) for n, s in shapes.items()], shard_bytes)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.write(name, torch.randn(shape, generator=g, dtype=torch.bfloat16))
    writer.close()
    return sum(torch.empty(s, dtype=torch.bfloat16, device="meta").nbytes for s in shapes.values())


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def sync() -> None:
    subprocess.run(["sync"], check=True)


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def settle() -> bool:
    """Flush, then drop the clean page cache where allowed (root): every timed step then
    starts with the same free memory and reads its input from disk. Otherwise whichever step
    follows a deletion gets the freed pages and the one after it pays for reclaiming them."""
    sync()
    try:
        DROP_CACHES.write_text("1\n")
    except OSError:
        return False
    return True


def timed_child(argv: list[str]) -> tuple[float, int]:
    """Run a child process; (seconds it reports, its peak RSS in bytes as it reports it)."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed with exit code {proc.returncode}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["seconds"], report["peak_rss"]


def peak_rss() -> int:
    """This process's own high-water RSS (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def copy_baseline(src: Path, dst: Path) -> float:
    settle()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    sync()
    return time.perf_counter() - start


def child(args: list[str]) -> None:
    """Inside the child: do one conversion and print its duration as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    what, src, dst = args[0], Path(args[1]), Path(args[2])
    from qwentitan.checkpoint import to_dcp, to_hf  # imports are not part of the timing

    # Settle here, after the imports, not in the parent before the child starts: `cp` starts
    # right after its settle, and so must we. On this VM (free page reporting on) memory freed
    # by the drop and then left idle for the seconds an import takes is handed back to the host,
    # and touching it again cost the same conversion 1.3-2x its system time (measured: to-hf of
    # the 1.7B shapes 4.0-5.3 s starting at once, 5.3-6.1 s starting 5 s after the drop).
    settle()
    start = time.perf_counter()
    if what == "to-dcp":
        to_dcp(src, dst)
    elif what == "to-hf":
        to_hf(src, dst)
    elif what == "titan-to-dcp":
        start = titan_to_dcp(src, dst)
    elif what == "titan-to-hf":
        start = titan_to_hf(src, dst, Path(args[3]))
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def _titan_state(hf_dir: Path):
    import torch

    from qwentitan.checkpoint.logits import titan_model_config

    config = json.loads((hf_dir / "config.json").read_text())
    model_config = titan_model_config(config, hf_dir / "config.json")
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")  # float32 parameters, as torchtitan trains them
    return model_config, model


def titan_to_dcp(src: Path, dst: Path) -> float:
    """torchtitan's HF load (CheckpointManager.dcp_load, from_hf=True) then a DCP save."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    start = time.perf_counter()  # allocating the float32 model is part of this route
    model_config, model = _titan_state(src)
    adapter = Qwen3StateDictAdapter(model_config, str(src))
    hf_state = adapter.to_hf(model.state_dict())
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(src)), no_dist=True)
    state = adapter.from_hf(hf_state)
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    return start


def titan_to_hf(src: Path, dst: Path, hf_dir: Path) -> float:
    """A DCP load into torchtitan's state dict, then CheckpointManager.dcp_save(to_hf=True)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    start = time.perf_counter()
    model_config, model = _titan_state(hf_dir)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(src), no_dist=True)
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}  # export_dtype=bfloat16
    adapter = Qwen3StateDictAdapter(model_config, str(hf_dir))
    hf_state = adapter.to_hf(state)
    mapping = adapter.fqn_to_index_mapping
    # As CheckpointManager.dcp_save(to_hf=True): shards per the source index, then consolidated.
    writer = HuggingFaceStorageWriter(
        path=str(dst / "sharded" if mapping else dst),
        save_distributed=True,
        fqn_to_index_mapping=mapping,
        enable_consolidation=not mapping,
    )
    dcp.save(hf_state, storage_writer=writer, no_dist=True)
    if mapping:
        consolidate_safetensors_files_on_every_rank(
            input_dir=str(dst / "sharded"),
            output_dir=str(dst),
            fqn_to_index_mapping=mapping,
            num_threads=5,
        )
    return start


def _short(label: str) -> str:
    return label.removeprefix("qwentitan-ckpt ").split()[0]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench_one(name: str, root: Path, skip_torchtitan: bool, repeat: int) -> list[tuple]:
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    config = SHAPES[name]
    src = root / f"{name}-hf"
    print(f"\n== {name}: generating a sharded bf16 checkpoint in {src} ...", flush=True)
    nbytes = generate(src, config)
    sync()
    print(
        f"   {nbytes / 1e9:.2f} GB of tensors, {folder_bytes(src) / 1e9:.2f} GB on disk", flush=True
    )
    rows = []

    dcp_dir, hf_back = root / f"{name}-dcp", root / f"{name}-back"
    runs: dict[str, list[tuple[float, int | None]]] = {}
    for attempt in range(repeat):
        # A fresh destination each round; to-hf reads this round's to-dcp output.
        for folder in (dcp_dir, hf_back):
            shutil.rmtree(folder, ignore_errors=True)
        runs.setdefault("cp -r + sync (baseline)", []).append(
            (copy_baseline(src, root / "copy"), None)
        )
        shutil.rmtree(root / "copy")  # the disk holds the source and at most two outputs
        for label, argv in (
            ("qwentitan-ckpt to-dcp", [*me, "to-dcp", str(src), str(dcp_dir)]),
            ("qwentitan-ckpt to-hf", [*me, "to-hf", str(dcp_dir), str(hf_back)]),
        ):
            runs.setdefault(label, []).append(timed_child(argv))
        print(
            f"   round {attempt + 1}: "
            + ", ".join(f"{_short(label)} {r[-1][0]:.1f} s" for label, r in runs.items()),
            flush=True,
        )
    copy_s = statistics.median(s for s, _ in runs["cp -r + sync (baseline)"])
    copy_best = min(s for s, _ in runs["cp -r + sync (baseline)"])
    for label, got in runs.items():
        seconds = statistics.median(s for s, _ in got)
        best = min(s for s, _ in got)
        rss = max((r for _, r in got if r is not None), default=None)
        rows.append(
            (name, label, seconds, nbytes / seconds / 1e9, rss, copy_s / seconds, copy_best / best)
        )

    from qwentitan.checkpoint import verify

    report = verify(src, dcp_dir)
    back = verify(hf_back, dcp_dir)
    print(
        f"   verify HF vs DCP: {'identical' if report.ok else 'DIFFERENT'}; "
        f"export vs DCP: {'identical' if back.ok else 'DIFFERENT'}",
        flush=True,
    )
    shutil.rmtree(hf_back)

    need, have = TORCHTITAN_NEEDS[name], available_memory()
    if skip_torchtitan or have < need:
        why = (
            "--skip-torchtitan"
            if skip_torchtitan
            else (f"needs ~{need / GiB:.0f} GiB free, {have / GiB:.1f} GiB available")
        )
        rows.append((name, f"torchtitan route: skipped ({why})", None, None, None, None, None))
        print(f"   torchtitan route skipped: {why}", flush=True)
    else:
        titan_dcp, titan_hf = root / f"{name}-titan-dcp", root / f"{name}-titan-hf"
        for label, argv in (
            (
                "torchtitan adapter + DCP HF reader -> DCP",
                [*me, "titan-to-dcp", str(src), str(titan_dcp)],
            ),
            (
                "torchtitan DCP -> adapter + DCP HF writer",
                [*me, "titan-to-hf", str(dcp_dir), str(titan_hf), str(src)],
            ),
        ):
            try:
                seconds, rss = timed_child(argv)
            except RuntimeError as e:
                rows.append((name, f"{label}: failed ({e})", None, None, None, None, None))
                continue
            rows.append((name, label, seconds, nbytes / seconds / 1e9, rss, copy_s / seconds, None))
            print(f"   {label}: {seconds:.1f} s, peak RSS {rss / GiB:.2f} GiB", flush=True)
        shutil.rmtree(titan_dcp, ignore_errors=True)
        shutil.rmtree(titan_hf, ignore_errors=True)
    shutil.rmtree(dcp_dir)
    shutil.rmtree(src)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["qwen3-1.7b", "qwen3-30b-a3b-4layers"], choices=list(SHAPES)
    )
    parser.add_argument(
        "--skip-torchtitan", action="store_true", help="never run torchtitan's route"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="interleaved rounds of cp / to-dcp / to-hf (the table shows median and fastest)",
    )
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temp data goes")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.workdir))
    rows = []
    try:
        for name in args.shapes:
            rows += bench_one(name, root, args.skip_torchtitan, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cold = settle()
    print(
        "\nevery timed step started "
        + ("with the page cache dropped (inputs read from disk)" if cold else "after a sync")
    )
    print(
        f"median of {args.repeat} interleaved rounds for cp, to-dcp and to-hf (x copy: median "
        "vs median, and fastest vs fastest); peak RSS is the largest of the rounds"
    )
    print(
        "\n| model | method | seconds | GB/s (tensor bytes) | peak RSS GiB | x copy throughput "
        "| x copy, fastest rounds |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, label, seconds, rate, rss, ratio, best_ratio in rows:
        cells = [
            f"{seconds:.1f}" if seconds is not None else "-",
            f"{rate:.2f}" if rate is not None else "-",
            f"{rss / GiB:.2f}" if rss is not None else "-",
            f"{ratio:.2f}" if ratio is not None else "-",
            f"{best_ratio:.2f}" if best_ratio is not None else "-",
        ]
        print(f"| {name} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
