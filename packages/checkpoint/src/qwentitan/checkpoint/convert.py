"""`to_dcp` and `to_hf`: stream Qwen3 weights between a Hugging Face folder and a DCP folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from qwentitan.checkpoint import dcp_read, dcp_write
from qwentitan.checkpoint.disk import differing_elements, nbytes_of
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.files import member
from qwentitan.checkpoint.hf_export import Exporter, dtype_name
from qwentitan.checkpoint.layout import (
    DTYPES,
    NON_MODEL_PREFIXES,
    Qwen3Layout,
    TitanTensor,
    read_config,
)
from qwentitan.checkpoint.output import byte_progress, check_destination, staged_folder
from qwentitan.checkpoint.safetensors_io import (
    DEFAULT_SHARD_SIZE,
    SHARD_PLAN,
    Entry,
    HFFolder,
    ShardedWriter,
    parse_size,
)

# Disk-bound work: a few threads keep the disk busy; more only add memory.
THREADS = max(2, min(4, os.cpu_count() or 2))
# Whether threads copying into one output shard take turns (see ShardedWriter).
SERIAL_SHARDS = True
# DCP pieces: tensors larger than this are written as row chunks along dim 0, so a 150k-vocab
# embedding or a layer's stacked experts streams through the writer threads in parts.
CHUNK_BYTES = 32 << 20
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_SIDE_FILES = ("config.json", "generation_config.json")
# A tokenizer's files as transformers saves them: copied beside an export when found beside its
# config, so the export loads with AutoTokenizer too.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def to_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Convert a Hugging Face Qwen3 / Qwen3-MoE folder into a torchtitan DCP folder.

    The DCP holds torchtitan 0.3.0's parameter names (experts stacked, the tied lm_head
    recreated from the embeddings, `expert_bias_E` zeros), the source dtypes unchanged, and a
    copy of config.json / generation_config.json so `to_hf` can go back without `--config`.
    """
    src, dst = Path(src), Path(dst)
    hf = HFFolder(src)
    config, config_file = read_config(src)
    layout = Qwen3Layout.from_config(config, config_file)
    layout.check_held(hf.shapes, config_file, src)
    check_hf_tensors(hf, layout, config_file)

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    sources: dict[str, dcp_write.Source] = {}
    aliases: dict[str, str] = {}  # the tied lm_head: same bytes as the embedding, stored once
    first_of: dict[tuple[str, ...], str] = {}
    for t in layout.titan_tensors():
        if t.hf_names and t.hf_names in first_of:
            aliases[t.name] = first_of[t.hf_names]
            continue
        first_of[t.hf_names] = t.name
        if not t.hf_names:  # expert_bias_E: torchtitan's load-balancing buffer starts at zero
            specs[t.name] = (t.shape, torch.float32)
            sources[t.name] = _zeros
            continue
        dtypes = {hf.tensors[n].dtype for n in t.hf_names}
        if len(dtypes) != 1:
            raise CheckpointError(
                f"the experts stacked into {t.name} mix dtypes {sorted(map(str, dtypes))} in "
                f"{src}; re-save the checkpoint in one dtype."
            )
        specs[t.name] = (t.shape, dtypes.pop())
        sources[t.name] = _source(hf, t, specs[t.name][1])

    total = sum(nbytes_of(s, d) for s, d in specs.values())
    files = sum(len(pieces) for pieces in dcp_write.plan(specs, CHUNK_BYTES).values())
    needs = _space_needed(total, files)
    check_destination(src, dst, overwrite, kind="dcp", needs=needs)
    with (
        staged_folder(dst, needs, overwrite=overwrite, kind="dcp") as tmp,
        byte_progress(f"to-dcp {src.name}", total) as advance,
    ):
        dcp_write.write(
            tmp,
            specs,
            sources,
            chunk_bytes=CHUNK_BYTES,
            threads=THREADS,
            on_written=advance,
            aliases=aliases,
        )
        for name in _SIDE_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        write_shard_plan(tmp, hf)
    return dst


def _zeros(start: int, stop: int) -> None:
    return None


def _source(hf: HFFolder, t: TitanTensor, dtype: torch.dtype) -> dcp_write.Source:
    """Where rows [start, stop) of `t` lie in the source files: one region of a plain tensor,
    or one region per expert of a stacked one."""
    if t.stacked:
        experts = [hf.tensors[name] for name in t.hf_names]
        return lambda start, stop: [(e.file, e.start, e.nbytes) for e in experts[start:stop]]
    stored = hf.tensors[t.hf_names[0]]
    row_bytes = nbytes_of(t.shape[1:], dtype)
    return lambda start, stop: [
        (stored.file, stored.start + start * row_bytes, (stop - start) * row_bytes)
    ]


def check_hf_tensors(hf: HFFolder, layout: Qwen3Layout, config_file: Path) -> None:
    """Every tensor config.json implies is present with its shape, and nothing else."""
    expected = layout.hf_shapes()
    for name, stored in hf.tensors.items():
        if _IGNORED_HF.fullmatch(name) or (name == "lm_head.weight" and layout.tie_word_embeddings):
            continue  # not parameters (rotary cache), or the tied copy HF itself ignores
        if name not in expected:
            raise CheckpointError(
                f"tensor {name!r} in {stored.file} is not a parameter of the model "
                f"{config_file} describes; pass the config.json that belongs to these weights "
                "or remove the stray tensor."
            )
        if stored.shape != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} in {stored.file} has shape {list(stored.shape)} but "
                f"{config_file} implies {list(expected[name])}; pass the config.json that "
                "belongs to these weights."
            )
        if not stored.dtype.is_floating_point:
            raise CheckpointError(
                f"tensor {name!r} in {stored.file} is {dtype_name(stored.dtype)}, but model "
                "weights are floating point; re-export the checkpoint with floating-point weights."
            )
    if layout.tie_word_embeddings and "lm_head.weight" in hf.tensors:
        _check_hf_tied_head(hf, config_file)
    missing = [n for n in expected if n not in hf.tensors]
    if missing:
        raise CheckpointError(
            f"{hf.path} lacks tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f" that {config_file} requires; download the missing shard or pass the matching "
            "config.json."
        )


def _check_hf_tied_head(hf: HFFolder, config_file: Path) -> None:
    """A tied config stores no lm_head: refuse a folder whose head is not its embedding."""
    head, embedding = hf.tensors["lm_head.weight"], hf.tensors["model.embed_tokens.weight"]
    numel = 1
    for s in head.shape:
        numel *= s
    differing = numel
    if head.shape == embedding.shape and head.dtype == embedding.dtype:
        differing = 0
        rows = head.shape[0] if head.shape else 1
        step = max(1, (CHUNK_BYTES // max(head.nbytes // max(rows, 1), 1)))
        for start in range(0, rows, step):
            region = (slice(start, min(start + step, rows)),)
            differing += differing_elements(
                hf.read_region(head.name, region), hf.read_region(embedding.name, region)
            )
    if differing:
        raise CheckpointError(
            f"{config_file} sets tie_word_embeddings=true but {hf.path} holds an lm_head.weight "
            f"that differs from model.embed_tokens.weight ({differing} of {numel} elements), "
            "which the conversion would drop; set tie_word_embeddings to false in config.json "
            "if the head was trained apart, or remove lm_head.weight."
        )


def to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int | None = None,
    overwrite: bool = False,
    allow_overflow: bool = False,
) -> Path:
    """Export a torchtitan Qwen3 DCP folder as a Hugging Face folder `from_pretrained` loads.

    `config` is the model's config.json (or its folder); by default the one `to_dcp` left in
    the DCP folder. `dtype` casts every tensor (default: as stored): a finite value the cast
    would turn into inf is refused unless `allow_overflow`, and the values turned into inf or
    rounded to 0 are counted in a warning. Experts are unstacked, the tied lm_head and
    torchtitan-only buffers dropped (a tied config with a head that differs from the
    embedding is refused); optimizer and other training state in the DCP folder are ignored.
    Shards: as the source was sharded when `to_dcp` recorded it and neither `max_shard_size`
    nor a `dtype` that changes sizes is given, else shards of at most `max_shard_size` (5GB).
    """
    src, dst = Path(src), Path(dst)
    ckpt = dcp_read.DCPFolder(src)
    cfg, config_file, config = _export_config(src, config)
    layout = Qwen3Layout.from_config(cfg, config_file)
    layout.check_held(ckpt.held_shapes(), config_file, src)
    export_dtype = _dtype(dtype)
    shard_bytes = parse_size(max_shard_size or DEFAULT_SHARD_SIZE)
    tensors = check_dcp_tensors(ckpt, layout, config_file)
    if layout.tie_word_embeddings:
        check_tied_head(ckpt, config_file)
    exported = [t for t in tensors if t.exported and t.hf_names]
    entries = _hf_entries(ckpt, exported, export_dtype)
    files = None
    if max_shard_size is None and all(
        export_dtype in (None, ckpt.tensors[t.name][1]) for t in exported
    ):
        files = read_shard_plan(src, [name for name, _, _ in entries])
    total = sum(nbytes_of(s, d) for _, d, s in entries)
    needs = _space_needed(total, len(entries))
    check_destination(src, dst, overwrite, kind="hf", needs=needs)
    exporter = Exporter(ckpt, export_dtype, allow_overflow)
    with (
        staged_folder(dst, needs, overwrite=overwrite, kind="hf") as tmp,
        byte_progress(f"to-hf {src.name}", total) as advance,
    ):
        writer = ShardedWriter(tmp, entries, shard_bytes, files, serial=SERIAL_SHARDS)
        bias = [t for t in tensors if not t.hf_names]
        exporter.run(writer, advance, exported + bias, THREADS)
        _write_side_files(tmp, cfg, Path(config), export_dtype)
    exporter.warn()
    return dst


def _export_config(
    src: Path, config: str | os.PathLike | None
) -> tuple[dict[str, Any], Path, str | os.PathLike]:
    """The config.json to export with: `config`, else the one `to_dcp` left in `src`."""
    if config is None:
        if not (src / "config.json").is_file():
            raise CheckpointError(
                f"{src} holds no config.json; pass --config with the config.json (or folder) of "
                "the Hugging Face model this checkpoint came from."
            )
        config = src
    cfg, config_file = read_config(config)
    return cfg, config_file, config


def _hf_entries(
    ckpt: dcp_read.DCPFolder, exported: list[TitanTensor], dtype: torch.dtype | None
) -> list[Entry]:
    """The Hugging Face tensors an export writes, in model order: (name, dtype, shape)."""
    entries = []
    for t in exported:
        out_dtype = dtype or ckpt.tensors[t.name][1]
        per = t.shape[1:] if t.stacked else t.shape
        entries += [(name, out_dtype, per) for name in t.hf_names]
    return entries


def write_shard_plan(folder: Path, hf: HFFolder) -> None:
    """Record, beside a DCP, which file of the source folder held each tensor."""
    plan = {"weight_map": {name: stored.file.name for name, stored in hf.tensors.items()}}
    (folder / SHARD_PLAN).write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")


def read_shard_plan(src: Path, names: list[str]) -> dict[str, str] | None:
    """The source's tensor -> file map `to_dcp` recorded in `src`, when it covers exactly the
    tensors exported (a DCP of another origin, or exported with another config, has none)."""
    path = src / SHARD_PLAN
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
        raise CheckpointError(
            f"{path} is not a valid shard plan; delete it (to-hf then shards by size) or pass "
            "--max-shard-size."
        ) from None
    for file in weight_map.values():
        # Plain names only: the export creates these files inside its own folder.
        member(src, file if str(file).endswith(".safetensors") else None, path)
    if set(weight_map) != set(names):
        return None
    return {name: weight_map[name] for name in names}


def check_tied_head(ckpt: dcp_read.DCPFolder, config_file: Path) -> None:
    """A tied config exports no lm_head: refuse a DCP whose head is not the embedding."""
    head, embedding = "lm_head.weight", "tok_embeddings.weight"
    if ckpt.storage.get(head) == ckpt.storage.get(embedding):
        return  # one stored tensor under both names, as to_dcp writes a tied head
    differing = 0
    for rows in ckpt.rows(head):
        part = ckpt.load_rows(rows)
        differing += differing_elements(part, ckpt.load_range(embedding, rows.start, rows.stop))
    if differing:
        numel = ckpt.tensors[head][0][0] * ckpt.tensors[head][0][1]
        raise CheckpointError(
            f"{config_file} sets tie_word_embeddings=true but {ckpt.path} holds an lm_head.weight "
            f"that differs from tok_embeddings.weight ({differing} of {numel} elements), which "
            "the export would drop; pass --config with a config.json that sets "
            "tie_word_embeddings=false."
        )


def _space_needed(total: int, files: int) -> int:
    """Bytes a conversion writes: the tensors, plus headers per file or tensor and side files."""
    return total + 4096 * files + (64 << 10)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(
            f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}."
        )
    return DTYPES[dtype]


def check_dcp_tensors(
    ckpt: dcp_read.DCPFolder, layout: Qwen3Layout, config_file: Path
) -> list[TitanTensor]:
    """The DCP holds exactly the model config.json describes, shape for shape."""
    tensors = layout.titan_tensors()
    model_keys = {k for k in ckpt.tensors if not k.startswith(NON_MODEL_PREFIXES)}
    unknown = sorted(model_keys - {t.name for t in tensors})
    # expert_bias_E exists only where torchtitan's load balancing is on; qwentitan's MoE
    # models train without it (HF cannot carry it), so their checkpoints lack it.
    tensors = [t for t in tensors if t.hf_names or t.name in ckpt.tensors]
    for t in tensors:
        if t.name not in ckpt.tensors:
            raise CheckpointError(
                f"{ckpt.path} lacks tensor {t.name!r} that {config_file} requires; pass the "
                "config.json of the model this checkpoint was trained from."
            )
        shape, dtype = ckpt.tensors[t.name]
        if shape != t.shape:
            raise CheckpointError(
                f"tensor {t.name!r} in {ckpt.path} has shape {list(shape)} but {config_file} "
                f"implies {list(t.shape)}; pass the config.json that belongs to this checkpoint."
            )
        if not dtype.is_floating_point:
            raise CheckpointError(
                f"tensor {t.name!r} in {ckpt.path} is {dtype_name(dtype)}, but model weights "
                "are floating point; re-save the checkpoint with floating-point weights."
            )
    if unknown:
        raise CheckpointError(
            f"tensor {unknown[0]!r} in {ckpt.path} is not a parameter of the model "
            f"{config_file} describes; pass the config.json that belongs to this checkpoint."
        )
    return tensors


def _write_side_files(
    folder: Path, config: dict[str, Any], config_path: Path, dtype: torch.dtype | None
) -> None:
    config = dict(config)
    if config.pop("auto_map", None) is not None:
        warnings.warn(
            "dropped auto_map from the exported config.json: the export is transformers' own "
            "Qwen3, and a trust_remote_code load would fetch the code auto_map names",
            stacklevel=1,  # here, in the package: the CLI shows the package's warnings
        )
    if dtype is not None:
        name = dtype_name(dtype)
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    source_dir = config_path if config_path.is_dir() else config_path.parent
    generation = source_dir / "generation_config.json"
    if generation.is_file():
        shutil.copyfile(generation, folder / "generation_config.json")
    else:
        fields = ("bos_token_id", "eos_token_id", "pad_token_id")
        gen = {k: config[k] for k in fields if config.get(k) is not None}
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, folder / name)
