"""Checkpoints of subnet-train: manifest and retention, corrupt/truncated/missing files
detected with a warning naming the file and the previous good checkpoint used, clear
errors when nothing is usable or the checkpoint belongs to another run, a failed save
that leaves the older checkpoints intact, and DDP resumed on another world size.

Most runs are one process in this process (fast); one uses 2 workers.
"""
import json
import os
import shutil
import warnings

import pytest
import torch

from subnet_ext import checkpoint as ck
from subnet_ext.state import checkpoint_store as layer_checkpoint
from subnet_ext.state.checkpoint_store import MANIFEST, read_manifest
from subnet_ext.cli.train import build_parser, check_args, main
from subnet_ext.jobs.run_checkpoints import load_full_model_state

TINY = ["--model", "mlp", "--width", "16", "--data", "digits", "--batch-size", "16", "--method", "sdp"]


def train(tmp_path, save_dir, *extra, steps=6, nproc=1, out="out"):
    out_dir = tmp_path / out
    code = main([*TINY, "--steps", str(steps), "--nproc", str(nproc), "--save-dir", str(save_dir),
                 "--out", str(out_dir), *extra])
    report = None
    if code == 0 and (out_dir / "report.json").exists():
        report = json.loads((out_dir / "report.json").read_text())
    return code, report


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One run: 6 steps, a checkpoint every 2, the newest 2 kept; and its report."""
    tmp = tmp_path_factory.mktemp("saved")
    code, report = train(tmp, tmp / "ck", "--save-every", "2", "--keep-last", "2")
    assert code == 0
    return tmp / "ck", report


def copy_of(saved_dir, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(saved_dir, dst)
    return dst


def first_data_file(folder):
    return next(os.path.join(folder, "state", f) for f in sorted(os.listdir(os.path.join(folder, "state")))
                if f.endswith(".distcp"))


def test_manifest_and_retention(saved):
    folder, report = saved
    assert sorted(os.listdir(folder)) == ["LATEST", "step-000004", "step-000006"]  # keep-last 2, no leftovers
    assert (folder / "LATEST").read_text() == "step-000006"
    manifest = read_manifest(str(folder / "step-000006"))
    assert manifest["step"] == 6 and manifest["world_size"] == 1
    assert {"state/.metadata", "model.pt"} <= set(manifest["files"])  # the final one has the full model
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"].values())
    assert "model.pt" not in read_manifest(str(folder / "step-000004"))["files"]
    assert json.loads(manifest["plan"])["format"] == "subnet_ext.plan/1"
    assert manifest["identity"]["method"] == "sdp" and manifest["ranks"][0]["rng"]["cpu"]
    assert manifest["history"]["loss"] == report["history"]["loss"]
    full = load_full_model_state(str(folder / "step-000006"))
    exported = torch.load(folder / "step-000006" / "model.pt")
    assert full.keys() == exported.keys() and all(torch.equal(full[k], exported[k]) for k in full)


@pytest.mark.parametrize("damage,expected", [
    ("flip", "(corrupt)"),
    ("truncate", "(truncated)"),
    ("manifest", "not valid JSON"),
    ("missing", "missing"),
    ("manifest_edit", "checksum does not match"),
])
def test_damaged_newest_checkpoint_falls_back_to_previous(saved, tmp_path, damage, expected):
    folder = copy_of(saved[0], tmp_path)
    newest = str(folder / "step-000006")
    data = first_data_file(newest)
    if damage == "flip":
        raw = bytearray(open(data, "rb").read())
        raw[len(raw) // 2] ^= 0x40
        open(data, "wb").write(bytes(raw))
    elif damage == "truncate":
        os.truncate(data, os.path.getsize(data) // 3)
    elif damage == "manifest":
        path = os.path.join(newest, MANIFEST)
        os.truncate(path, os.path.getsize(path) // 2)
    elif damage == "missing":
        os.remove(data)
    else:  # still valid JSON, but not what was written
        path = os.path.join(newest, MANIFEST)
        text = open(path).read().replace('"step": 6', '"step": 7')
        open(path, "w").write(text)
    with pytest.warns(RuntimeWarning, match="step-000006") as record:
        code, report = train(tmp_path, folder, "--resume", steps=8, out="resumed")
    assert code == 0
    message = " ".join(str(w.message) for w in record)
    assert expected in message and "trying an older one" in message, message
    if damage in ("flip", "truncate", "missing"):
        assert os.path.basename(data) in message
    # Resumed from step 4: steps 5 and 6 are recomputed exactly as the first run did them.
    assert report["history"]["step"] == list(range(1, 9))
    assert report["history"]["loss"][:6] == pytest.approx(saved[1]["history"]["loss"], rel=1e-6, abs=1e-7)


def test_no_good_checkpoint_is_a_clear_error(saved, tmp_path, capsys):
    folder = copy_of(saved[0], tmp_path)
    for step in ("step-000004", "step-000006"):
        os.remove(first_data_file(str(folder / step)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _ = train(tmp_path, folder, "--resume", steps=8)
    err = capsys.readouterr().err
    assert code == 1 and "no good checkpoint" in err and "step-000004" in err and "step-000006" in err, err


@pytest.mark.parametrize("extra,message", [
    (["--width", "24"], "width 16 vs 24"),
    (["--method", "ddp"], "method 'sdp' vs 'ddp'"),
    (["--seed", "3"], "seed 0 vs 3"),
])
def test_checkpoint_of_another_run_is_refused(saved, tmp_path, capsys, extra, message):
    folder = copy_of(saved[0], tmp_path)
    code, _ = train(tmp_path, folder, "--resume", *extra, steps=8)
    err = capsys.readouterr().err
    assert code == 1 and "belongs to another run" in err and message in err, err


def test_resume_auto_and_no_silent_overwrite(saved, tmp_path, capsys):
    # auto with nothing saved starts fresh; a fresh run into a folder with checkpoints is refused.
    code, report = train(tmp_path, tmp_path / "empty", "--resume", "auto", steps=2)
    assert code == 0 and report["history"]["step"] == [1, 2]
    parser = build_parser()
    with pytest.raises(SystemExit):
        check_args(parser, parser.parse_args([*TINY, "--save-dir", str(saved[0])]))
    assert "already holds checkpoints" in capsys.readouterr().err


def test_failed_save_keeps_previous_checkpoints(tmp_path, monkeypatch):
    real_commit, calls = layer_checkpoint._commit, []

    def disk_full_once(*args, **kwargs):
        calls.append(args[-1])
        if len(calls) == 2:  # the step-4 save
            raise OSError(28, "No space left on device")
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(layer_checkpoint, "_commit", disk_full_once)
    with pytest.warns(RuntimeWarning, match="checkpoint of step 4 .* was not written.*No space left"):
        code, _ = train(tmp_path, tmp_path / "ck", "--save-every", "2", steps=6)
    assert code == 0
    assert sorted(os.listdir(tmp_path / "ck")) == ["LATEST", "step-000002", "step-000006"]
    assert ck.verify_checkpoint(str(tmp_path / "ck" / "step-000002"))["step"] == 2


def test_ddp_checkpoint_resumes_on_another_world_size(tmp_path):
    ddp = ["--method", "ddp"]
    code, _ = train(tmp_path, tmp_path / "ck", *ddp, "--save-every", "2", "--stop-after", "2", "--verify-every", "1",
                    nproc=2, out="a")
    assert code == 0 and (tmp_path / "ck" / "LATEST").read_text() == "step-000002"
    saved = load_full_model_state(str(tmp_path / "ck" / "step-000002"))
    code, report = train(tmp_path, tmp_path / "ck", *ddp, "--resume", steps=3, out="b")
    assert code == 0 and report["world_size"] == 1 and report["history"]["step"] == [1, 2, 3]
    after = load_full_model_state(str(tmp_path / "ck" / "step-000003"))
    assert saved.keys() == after.keys()
    assert any(not torch.equal(saved[k], after[k]) for k in saved)  # it trained on from there


def test_resume_from_an_explicit_folder(saved, tmp_path, capsys):
    folder = copy_of(saved[0], tmp_path)
    older = str(folder / "step-000004")
    code, report = train(tmp_path, tmp_path / "branch", "--resume", older, steps=6, out="branch")
    assert code == 0 and report["history"]["step"] == list(range(1, 7))
    assert report["history"]["loss"] == pytest.approx(saved[1]["history"]["loss"], rel=1e-6, abs=1e-7)
    os.remove(first_data_file(older))  # an explicit checkpoint is that one or an error, no fallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _ = train(tmp_path, tmp_path / "branch2", "--resume", older, steps=6, out="branch2")
    err = capsys.readouterr().err
    assert code == 1 and "step-000004" in err and "missing" in err, err
