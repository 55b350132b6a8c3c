"""The offline corpus: English text every Python installation carries, so training needs no download.

Documents, in a fixed order: each topic of the interpreter's own help (`pydoc_data.topics`, the
text behind `help("if")`), then, per top-level standard-library module in name order, its
docstrings (module, classes, functions) read from source with `ast`, so nothing is imported.
The same interpreter always yields the same bytes; the build is cached by Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from qwentitan.launch.data.cache import atomic_folder, cache_root

__all__ = ["CORPUS_FILE", "build_corpus", "corpus_documents", "offline_corpus"]

CORPUS_FILE = "corpus.jsonl"
MANIFEST_FILE = "manifest.json"
_VERSION = 1  # bump when the document recipe changes, so old caches are not reused


def _help_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def _module_docstrings(source: Path) -> str:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                title = "" if isinstance(node, ast.Module) else f"{node.name}\n"
                parts.append(title + doc.strip())
    return "\n\n".join(parts)


def _stdlib_docstrings() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py")):
        text = _module_docstrings(source)
        if text:
            yield f"Module {source.stem}\n\n{text}"


def corpus_documents() -> Iterator[str]:
    """Every document of the offline corpus, in order."""
    yield from _help_topics()
    yield from _stdlib_docstrings()


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
        build_corpus(folder)
    return folder / CORPUS_FILE
