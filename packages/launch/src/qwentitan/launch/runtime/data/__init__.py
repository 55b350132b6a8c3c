"""Data for training without a download: the offline corpus, Qwen3's tokenizer, dataset loaders."""

from qwentitan.launch.runtime.data.check import check_dataset, check_json_lines
from qwentitan.launch.runtime.data.corpus import build_corpus, corpus_documents, offline_corpus
from qwentitan.launch.runtime.data.loader import (
    OFFLINE,
    DataSource,
    TextDataLoader,
    resolve_dataset,
)
from qwentitan.launch.runtime.data.tokenizer import (
    QWEN3_PADDED_VOCAB,
    QWEN3_SPECIAL_TOKENS,
    build_qwen_tokenizer,
    check_tokenizer_folder,
    qwen_tokenizer_folder,
)

__all__ = [
    "OFFLINE",
    "QWEN3_PADDED_VOCAB",
    "QWEN3_SPECIAL_TOKENS",
    "DataSource",
    "TextDataLoader",
    "build_corpus",
    "build_qwen_tokenizer",
    "check_dataset",
    "check_json_lines",
    "check_tokenizer_folder",
    "corpus_documents",
    "offline_corpus",
    "qwen_tokenizer_folder",
    "resolve_dataset",
]
