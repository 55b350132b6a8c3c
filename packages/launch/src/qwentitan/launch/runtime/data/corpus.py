"""The offline corpus: English text every Python installation carries, so training needs no download.

Documents: each topic of the interpreter's own help (`pydoc_data.topics`, the text behind
`help("if")`) and each docstring (module, class, function) of the top-level standard-library
modules, read from source with `ast` so nothing is imported, titled with its qualified name.
They are shuffled with a fixed seed, so any window of training text mixes prose, reference and
code docs much like the whole corpus does. The same interpreter always yields the same bytes;
the build is cached by Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from qwentitan.checkpoint.files import atomic_folder
from qwentitan.launch.base.env_defaults import cache_root

__all__ = ["CORPUS_FILE", "build_corpus", "corpus_documents", "offline_corpus"]

CORPUS_FILE = "corpus.jsonl"
MANIFEST_FILE = "manifest.json"
_SEED = 0
_VERSION = 2  # bump when the document recipe changes, so old caches are not reused


def _help_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def _docstrings(source: Path) -> Iterator[str]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                name = source.stem if isinstance(node, ast.Module) else f"{source.stem}.{node.name}"
                yield f"{name}\n\n{doc.strip()}"


def _stdlib_docstrings() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py")):
        yield from _docstrings(source)


def corpus_documents() -> list[str]:
    """Every document of the offline corpus, in its fixed shuffled order."""
    documents = [*_help_topics(), *_stdlib_docstrings()]
    random.Random(_SEED).shuffle(documents)
    return documents


def build_corpus(folder: Path) -> Path:
    """Write the corpus as c4-style JSON lines (`{"text": ...}`) into `folder`; return the file."""
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        digest = hashlib.sha256()
        count = 0
        with open(tmp / CORPUS_FILE, "w", encoding="utf-8") as out:
            for text in corpus_documents():
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                out.write(line)
                digest.update(line.encode())
                count += 1
        manifest = {
            "documents": count,
            "sha256": digest.hexdigest(),
            "python": sys.version.split()[0],
            "recipe_version": _VERSION,
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder / CORPUS_FILE


def offline_corpus(cache: Path | None = None) -> Path:
    """The cached corpus file, built on first use (a few seconds)."""
    python = ".".join(map(str, sys.version_info[:3]))
    folder = (cache or cache_root()) / f"corpus-v{_VERSION}-py{python}"
    if not (folder / CORPUS_FILE).exists():
        started = time.perf_counter()
        build_corpus(folder)
        said_once(f"built the offline corpus once into {folder}", started)
    return folder / CORPUS_FILE


def said_once(done: str, started: float) -> None:
    """One line on stderr for a cache built on the first run (`train` would otherwise be
    silent for those seconds): what was built, where, how long it took. The process's own
    stderr: the recipe's config, which builds the tokenizer, is loaded with sys.stderr caught."""
    seconds = time.perf_counter() - started
    out = sys.__stderr__ or sys.stderr
    print(f"qwentitan: {done} in {seconds:.1f} s; later runs reuse it.", file=out, flush=True)
