"""Tiny Shakespeare as nanoGPT's benchmark (subnet_ext/data/shakespeare.py): the split, vocabulary and
checksum against nanoGPT's prepare.py recomputed here in plain Python, the errors for a missing or
changed file, every validation window, and the task the command line and the study train on.

The file lives outside the repository (../shared/data/tinyshakespeare.txt beside it, or
$SUBNET_EXT_TINY_SHAKESPEARE); tests that read it need it there."""
import hashlib

import pytest
import torch

from subnet_ext.data.char_windows import CharWindows
from subnet_ext.data.shakespeare import (ENVIRONMENT_VARIABLE, SHA256, char_corpus, load_tiny_shakespeare,
                                         resolve_path)
from shakespeare_file import PATH, needs_tiny_shakespeare as needs_file


def _prepare(text: str):
    """nanoGPT's data/shakespeare_char/prepare.py, as it is written there: the sorted characters, stoi, and the
    first 90% of the ids for training."""
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    return chars, [stoi[c] for c in text[:int(n * 0.9)]], [stoi[c] for c in text[int(n * 0.9):]]


@needs_file
def test_the_split_and_vocabulary_are_nanogpts():
    text = open(PATH, encoding="utf-8").read()
    chars, train, val = _prepare(text)
    corpus = load_tiny_shakespeare(PATH)
    assert corpus.vocab == "".join(chars) and len(chars) == 65
    assert (len(train), len(val)) == (1_003_854, 111_540)
    assert corpus.train.tolist() == train and corpus.val.tolist() == val
    assert corpus.sha256 == hashlib.sha256(text.encode()).hexdigest() == SHA256
    assert corpus.decode(corpus.train[:14]) == "First Citizen:"
    assert corpus.encode("First Citizen:").tolist() == train[:14]


def test_a_missing_file_says_where_and_what(tmp_path, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with pytest.raises(FileNotFoundError, match=ENVIRONMENT_VARIABLE):
        resolve_path(None)
    missing = str(tmp_path / "input.txt")
    with pytest.raises(FileNotFoundError, match=f"{missing!r} is not a file.*{SHA256}"):
        load_tiny_shakespeare(missing)


def test_another_text_is_refused_by_its_checksum(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("First Citizen:\r\nBefore we proceed any further, hear me speak.\r\n")  # changed line endings
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=f"has SHA-256 {digest}.*not {SHA256}"):
        load_tiny_shakespeare(str(path))


def test_char_corpus_is_prepare_py_on_any_text():
    text = "to be, or not to be: that is the question\n" * 7
    chars, train, val = _prepare(text)
    corpus = char_corpus(text)
    assert corpus.vocab == "".join(chars)
    assert corpus.train.tolist() == train and corpus.val.tolist() == val
    with pytest.raises(ValueError, match="at least 2 characters"):
        char_corpus("a")


def test_every_window_predicts_each_character_once():
    chars = torch.arange(23, dtype=torch.uint8)
    x, y = CharWindows(chars, seq_len=5).every_window()
    assert x.shape == y.shape == (4, 5)  # (23 - 1) // 5 windows
    assert y.flatten().tolist() == list(range(1, 21))  # targets 1..20 once each, in order
    assert (x + 1 == y).all()


@needs_file
def test_the_task_trains_and_evaluates_on_every_validation_window():
    from subnet_ext.jobs.tasks import build_task

    task = build_task(f"shakespeare:{PATH}", "gpt", "shakespeare", 3, 64, seed=0)
    x, y = task.batch(0, 1, 4)
    assert x.shape == y.shape == (3, 64) and int(x.max()) < 65
    assert (task.batch(0, 1, 4)[0] == x).all() and not (task.batch(0, 2, 4)[0] == x).all()
    held_out = list(task.eval_batches())
    windows = sum(len(b[0]) for b in held_out)
    assert windows == (111_540 - 1) // 64
    assert task.make_model().config.vocab_size == 65
