"""`qwentitan-ckpt {to-dcp,to-hf,verify}`: the three verbs, user errors as one line and exit 2.

Each verb imports only what it runs: the parser and `--help` need no torch.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from qwentitan.checkpoint.errors import CheckpointError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the fix, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qwentitan-ckpt",
        description="Convert Qwen3 weights between Hugging Face safetensors and torch DCP "
        "(torchtitan's layout), streaming, and verify them bit for bit.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("to-dcp", help="Hugging Face folder -> DCP folder torchtitan loads")
    p.add_argument("src", help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("dst", help="DCP folder to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")

    p = sub.add_parser("to-hf", help="DCP folder -> Hugging Face folder from_pretrained loads")
    p.add_argument("src", help="DCP folder (to-dcp output or a torchtitan step-N folder)")
    p.add_argument("dst", help="Hugging Face folder to create")
    p.add_argument("--config", help="config.json, or its folder (default: SRC/config.json)")
    p.add_argument(
        "--dtype", help="export dtype: bfloat16, float32 or float16 (default: as stored)"
    )
    p.add_argument(
        "--max-shard-size",
        help="largest shard, e.g. 5GB (default: as the source was sharded when to-dcp recorded "
        "it and --dtype keeps the sizes, else 5GB)",
    )
    p.add_argument(
        "--allow-overflow",
        action="store_true",
        help="let --dtype turn values beyond its range into inf (refused by default)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")

    p = sub.add_parser("verify", help="compare a Hugging Face folder with a DCP folder")
    p.add_argument("hf_dir", help="Hugging Face model folder")
    p.add_argument("dcp_dir", help="DCP folder")
    p.add_argument(
        "--logits",
        action="store_true",
        help="also compare logits of the HF model and torchtitan's Qwen3 loaded from the DCP "
        "(needs the `logits` extra)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            return _run(args)
        except CheckpointError as e:
            print(f"qwentitan-ckpt: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before anything was written (staged_folder handles after)
            print("qwentitan-ckpt: error: interrupted; nothing was written.", file=sys.stderr)
            return 2
        finally:
            for w in caught:
                if w.filename.startswith(str(Path(__file__).parent)):
                    print(f"note: {w.message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.command == "verify":
        from qwentitan.checkpoint.verification import verify

        report = verify(args.hf_dir, args.dcp_dir, logits=args.logits)
        print(report.format())
        return 0 if report.ok else 1
    from qwentitan.checkpoint.convert import to_dcp, to_hf

    if args.command == "to-dcp":
        out = to_dcp(args.src, args.dst, overwrite=args.overwrite)
    elif args.command == "to-hf":
        out = to_hf(
            args.src,
            args.dst,
            config=args.config,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            allow_overflow=args.allow_overflow,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
