"""The pysrc corpus (the standard library's ASCII sources as characters), its CLI task with
the GPT, and the CLI's handling of models that return (logits, loss).

References: file splits and byte contents rebuilt here from the files with hashlib and
plain reads; losses from F.cross_entropy on the logits directly.
"""
import hashlib
import os
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from subnet_ext.jobs.arguments import training_args
from subnet_ext.jobs.tasks import build_task, logits_of
from subnet_ext.data.char_windows import CharWindows
from subnet_ext.data.pysrc import load_pysrc


def _write(folder, rel, data: bytes):
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _expected_split(rel: str) -> str:
    return "val" if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 10 == 0 else "train"


def test_corpus_splits_by_file_skips_non_ascii_and_site_packages(tmp_path):
    files = {f"pkg{i // 7}/mod{i}.py": f"def f{i}():\n    return {i}\n".encode() for i in range(60)}
    for rel, data in files.items():
        _write(tmp_path, rel, data)
    _write(tmp_path, "pkg0/accents.py", "s = 'café'\n".encode())  # not ASCII: skipped
    _write(tmp_path, "site-packages/extra.py", b"x = 1\n")  # installed packages: not the library
    _write(tmp_path, "pkg0/notes.txt", b"not python\n")
    corpus = load_pysrc(str(tmp_path))
    expected = {"train": b"", "val": b""}
    for rel in sorted(files, key=lambda r: (os.path.dirname(r), os.path.basename(r))):
        expected[_expected_split(rel)] += files[rel]
    assert expected["val"], "the fixture must put at least one file in validation"
    assert bytes(corpus.train.tolist()) == expected["train"]
    assert bytes(corpus.val.tolist()) == expected["val"]
    d = corpus.describe()
    assert d["skipped_non_ascii_files"] == 1
    assert d["files"]["train"] + d["files"]["val"] == len(files)
    assert d["characters"]["val"] == len(expected["val"])


def test_corpus_refuses_a_tree_without_both_splits(tmp_path):
    _write(tmp_path, "only.py", b"x = 1\n")
    with pytest.raises(ValueError, match="both splits"):
        load_pysrc(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_pysrc(str(tmp_path / "missing"))


def test_standard_library_corpus_is_ascii_and_split():
    corpus = load_pysrc()
    assert corpus.root == sysconfig.get_paths()["stdlib"]
    assert corpus.train.numel() > 1_000_000 and corpus.val.numel() > 100_000
    assert int(corpus.train.max()) < 128 and int(corpus.val.max()) < 128
    share = corpus.val_files / (corpus.train_files + corpus.val_files)
    assert 0.05 < share < 0.15  # one file in ten, by hash


def test_windows_are_shifted_by_one_character():
    chars = torch.arange(100, dtype=torch.uint8)
    w = CharWindows(chars, seq_len=8)
    x, y = w.batch(5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # the corpus counts up, so the next character is x + 1
    xe, ye = w.evenly_spaced(3)
    assert xe[:, 0].tolist() == [0, 46, 91] and torch.equal(ye, xe + 1)
    with pytest.raises(ValueError, match="seq_len"):
        CharWindows(chars[:5], seq_len=8)


def test_gpt_task_on_pysrc_batches_and_held_out_set():
    task = build_task("pysrc", "gpt", "tiny", batch_size=4, seq_len=32, seed=3, eval_sequences=10)
    x, y = task.batch(7, 1, 2)
    x2, _ = task.batch(7, 1, 2)
    x3, _ = task.batch(7, 0, 2)
    assert x.shape == (4, 32) and torch.equal(x, x2) and not torch.equal(x, x3)
    held = list(task.eval_batches())
    assert [len(b[0]) for b in held] == [4, 4, 2]  # 10 windows in batches of 4
    val = load_pysrc().val
    assert bytes(held[0][0][0].tolist()) == bytes(val[:32].tolist())  # the first window starts the split
    model = task.make_model()
    out = model(x)
    assert isinstance(out, tuple)  # nanoGPT's (logits, loss)
    assert torch.allclose(task.loss(out, y), F.cross_entropy(out[0].reshape(-1, 128), y.reshape(-1)))


def test_gpt_refuses_sequences_beyond_its_context_and_small_vocabularies():
    with pytest.raises(ValueError, match="exceeds"):
        training_args(model="gpt", preset="tiny", data="pysrc", seq_len=65)
    with pytest.raises(ValueError, match="exceeds"):
        build_task("pysrc", "gpt", "tiny", batch_size=2, seq_len=65, seed=0)
    with pytest.raises(ValueError, match="not a gpt preset"):
        training_args(model="gpt", preset="huge")
    from subnet_ext.models.llama import LLAMA_PRESETS

    small = [p for p, c in LLAMA_PRESETS.items() if c.vocab_size < 128]
    if small:
        with pytest.raises(ValueError, match="vocabulary"):
            build_task("pysrc", "llama", small[0], batch_size=2, seq_len=8, seed=0)


def test_logits_of_accepts_tensors_tuples_and_objects_and_refuses_the_rest():
    t = torch.zeros(2, 3)
    assert logits_of(t) is t and logits_of((t, None)) is t

    class Out:
        logits = t

    assert logits_of(Out()) is t
    with pytest.raises(TypeError, match="expected the model to return logits"):
        logits_of({"logits": t})
