"""`qwentitan-ckpt to-dcp` / `to-hf`, whole commands, against `cp -r` + `sync` of the same folder.

Generates (in a child process, so this one stays small) a Hub-style sharded bf16 checkpoint with
Qwen3-1.7B's shapes (~3.4 GB; `--shapes` picks others, `tiny` for a quick try) in a temporary
folder, then runs, as a user would, in 3 interleaved rounds after one untimed warm-up round
(so the page cache is warm, as it is right after a download or a training run); after each
command, the outputs no later command reads are deleted and synced, so each writes into the
same free memory:

- `python -c "import torch"`: what any converter pays before its first byte, subtracted;
- `cp -r SRC COPY && sync`: the disk's own speed, the baseline;
- `dd if=/dev/zero of=FILE bs=1M count=N conv=fdatasync` of the same byte count: the disk's
  sequential write speed, nothing read, the second baseline;
- `qwentitan-ckpt to-dcp SRC DCP` and `qwentitan-ckpt to-hf DCP BACK` (each syncs its output
  before renaming it into place, like the `sync` after `cp`).

Prints the machine (cores, memory, load, file system), each round, the medians, each
converter's ratio to cp and to dd net of the bare torch import (cp seconds / (converter seconds
- import torch seconds); goals: to-hf >= 0.8, to-dcp >= 1.0), and each command's peak
RSS (the child's own ru_maxrss from wait4; goal <= 1.5 GiB). Ends with `qwentitan-ckpt verify`
of the source against the DCP and of the export against the DCP (bit for bit).

Run: `uv run nox -s bench -- checkpoint [--shapes qwen3-0.6b]` or
`uv run python benchmarks/bench_checkpoint.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
DD_BLOCK = 1 << 20
IMPORT, CP, DD = "python -c 'import torch'", "cp -r + sync", "dd conv=fdatasync"
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

# Qwen3-0.6B's shapes (1.2 GB): the same kinds of tensors as 1.7B, for a loaded machine.
SHAPES["qwen3-0.6b"] = SHAPES["qwen3-1.7b"] | {"hidden_size": 1024, "intermediate_size": 3072}


def generate(folder: Path, config: dict, shards: int) -> None:
    """A Hub-style bf16 folder of about `shards` equal shards, one random tensor at a time."""
    import torch

    from qwentitan.checkpoint.disk import nbytes_of
    from qwentitan.checkpoint.layout import Qwen3Layout
    from qwentitan.checkpoint.safetensors_io import ShardedWriter

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    shapes = Qwen3Layout.from_config(config, "bench").hf_shapes()
    entries = [(n, torch.bfloat16, s) for n, s in shapes.items()]
    sizes = [nbytes_of(s, d) for _, d, s in entries]
    # Filled in order, shards of this bound come out `shards` in number, not one more.
    shard_bytes = -(-sum(sizes) // shards) + max(sizes)
    writer = ShardedWriter(folder, entries, shard_bytes)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.write(name, torch.randn(shape, generator=g, dtype=torch.bfloat16))
    writer.close()


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """Run a whole command: (wall seconds, its peak RSS in bytes, its CPU seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed with exit code {proc.returncode}")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _paths(base: Path) -> tuple[Path, ...]:
    """source, cp's copy, DCP, export, the `--before` DCP and export, dd's file."""
    kinds = ("hf", "copy", "dcp", "back", "old-dcp", "old-back", "dd")
    return tuple(base.parent / f"{base.name}-{kind}" for kind in kinds)


def _commands(
    ckpt: str, size: int, base: Path, before: Path | None
) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """The timed commands, in the order each round runs them, and their environments."""
    src, copy, dcp, back, old_dcp, old_back, raw = _paths(base)
    commands = {
        IMPORT: [sys.executable, "-c", "import torch"],
        CP: ["sh", "-c", f'cp -r "{src}" "{copy}" && sync'],
        # The disk's sequential write speed for the same bytes, nothing read.
        DD: [
            "dd",
            "if=/dev/zero",
            f"of={raw}",
            f"bs={DD_BLOCK}",
            f"count={-(-size // DD_BLOCK)}",
            "conv=fdatasync",
            "status=none",
        ],
        "qwentitan-ckpt to-dcp": [ckpt, "to-dcp", str(src), str(dcp)],
        "qwentitan-ckpt to-hf": [ckpt, "to-hf", str(dcp), str(back)],
    }
    envs: dict[str, dict[str, str]] = {}
    if before is not None:  # another version of the package, e.g. landed main's, in this run
        commands["before: to-dcp"] = [ckpt, "to-dcp", str(src), str(old_dcp)]
        commands["before: to-hf"] = [ckpt, "to-hf", str(old_dcp), str(old_back)]
        old = dict(os.environ, PYTHONPATH=str(before))
        envs = {"before: to-dcp": old, "before: to-hf": old}
    return commands, envs


def bench(name: str, root: Path, rounds: int, before: Path | None, shards: int) -> None:
    src, copy, dcp, back, old_dcp, old_back, raw = _paths(root / name)
    print(f"== {name}: generating a {shards}-shard bf16 checkpoint in {src} ...", flush=True)
    generator = [sys.executable, __file__, "--generate", name, str(src), str(shards)]
    subprocess.run(generator, check=True)
    subprocess.run(["sync"], check=True)
    size = folder_bytes(src)
    print(f"   {size / 1e9:.2f} GB on disk", flush=True)
    _describe_machine(root)
    ckpt = shutil.which("qwentitan-ckpt", path=Path(sys.executable).parent) or shutil.which(
        "qwentitan-ckpt"
    )
    if ckpt is None:
        sys.exit("qwentitan-ckpt is not installed here; run `uv sync --all-packages`.")
    commands, envs = _commands(ckpt, size, root / name, before)
    times: dict[str, list[float]] = {label: [] for label in commands}
    cpu: dict[str, list[float]] = {label: [] for label in commands}
    rss: dict[str, int] = {}
    for attempt in range(rounds + 1):  # round 0 warms the page cache and is not counted
        for folder in (dcp, back, old_dcp, old_back):  # cp's copy and dd's file: gone already
            shutil.rmtree(folder, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        got = {}
        for label, argv in commands.items():
            got[label] = run(argv, envs.get(label))
            # What no later command reads (cp's copy, dd's file) is deleted, and its pages with
            # it: each command writes into the same free page cache, not into the reclaim that
            # the commands before it left (on a 24 GiB machine, five copies of 1.7B fill it).
            shutil.rmtree(copy, ignore_errors=True)
            raw.unlink(missing_ok=True)
            subprocess.run(["sync"], check=True)
        if attempt == 0:
            continue
        for label, (seconds, peak, cpu_s) in got.items():
            times[label].append(seconds)
            cpu[label].append(cpu_s)
            rss[label] = max(rss.get(label, 0), peak)
        print(
            f"   round {attempt}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in got.items()),
            flush=True,
        )
    _report(name, size, rounds, times, cpu, rss)
    for a, b in ((src, dcp), (back, dcp)):
        proc = subprocess.run([ckpt, "verify", str(a), str(b)], capture_output=True, text=True)
        print(f"\nverify {a.name} against {b.name}: {proc.stdout.strip().splitlines()[-1]}")
        if proc.returncode != 0:
            raise SystemExit(proc.stdout + proc.stderr)


def _report(
    name: str,
    size: int,
    rounds: int,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    rss: dict[str, int],
) -> None:
    """The table: medians, each converter against cp and dd net of the bare torch import."""
    median = {label: statistics.median(t) for label, t in times.items()}
    median_cpu = {label: statistics.median(t) for label, t in cpu.items()}
    torch_s, torch_cpu = median[IMPORT], median_cpu[IMPORT]
    print(
        f"\n{name}, {size / 1e9:.2f} GB, warm page cache: median of {rounds} interleaved rounds; "
        "x cp = cp / (command - import torch), goal >= 0.8 (to-hf), >= 1.0 (to-dcp); x dd "
        "likewise against a sequential write of the same bytes; peak RSS goal <= 1.5 GiB"
    )
    print(f"load average after the rounds: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        "\n| command | median s | rounds s | x cp | x dd | CPU s | CPU s net of import torch "
        "| peak RSS GiB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for label, seconds in median.items():
        x_cp = x_dd = net_cpu = "-"
        if "to-" in label:
            x_cp = f"{median[CP] / (seconds - torch_s):.2f}"
            x_dd = f"{median[DD] / (seconds - torch_s):.2f}"
            net_cpu = f"{median_cpu[label] - torch_cpu:.2f}"
        print(
            f"| `{label}` | {seconds:.2f} | {' / '.join(f'{t:.2f}' for t in times[label])} "
            f"| {x_cp} | {x_dd} | {median_cpu[label]:.2f} | {net_cpu} | {rss[label] / GiB:.2f} |"
        )


def _describe_machine(root: Path) -> None:
    """Where the numbers come from: cores, memory, load and the file system written to."""
    fs = subprocess.run(
        ["df", "--output=fstype,source", str(root)], capture_output=True, text=True
    ).stdout.split()[-2:]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    print(
        f"   machine: {os.cpu_count()} cores, {memory:.0f} GiB memory, load average "
        f"{os.getloadavg()[0]:.2f}; {root} on {' '.join(fs)}",
        flush=True,
    )


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--generate":
        generate(Path(sys.argv[3]), SHAPES[sys.argv[2]], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-1.7b"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds")
    parser.add_argument(
        "--source-shards",
        type=int,
        default=2,
        help="at most this many shards in the generated source (Hub: 2)",
    )
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the data goes")
    parser.add_argument(
        "--before",
        type=Path,
        help="the src/ folder of another version of qwentitan-checkpoint (e.g. from `git "
        "archive main`) whose to-dcp / to-hf run in the same rounds, for a before/after table",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.workdir))
    try:
        for name in args.shapes:
            bench(name, root, args.rounds, args.before, args.source_shards)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
