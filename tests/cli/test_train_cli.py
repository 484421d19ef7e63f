"""subnet-train end to end on tiny settings: each method with 2 gloo workers, resume after
an interruption, and every bad argument or data path giving a clear error."""
import json
import os
import subprocess
import sys

import pytest
import torch

from subnet_ext.cli.train import build_parser, check_args, main

TINY = ["--model", "mlp", "--data", "digits", "--steps", "6", "--batch-size", "16", "--nproc", "2"]
# Digits has 10 classes (chance 0.10). After TINY's 6 steps DDP and FSDP2 reach 0.72 test
# accuracy and the loss falls from 2.26 to 1.23 (measured); SDP's subnetworks learn a little
# slower. 0.30 (3x chance) is safely below all of them and fails for a run that did not learn.
MIN_ACCURACY = 0.30


def assert_learned(report):
    """The run learned: test accuracy well above chance and the last loss below the first."""
    accuracy, loss = report["final"]["full"]["accuracy"], report["history"]["loss"]
    assert accuracy >= MIN_ACCURACY, (accuracy, loss)
    assert loss[-1] < 0.8 * loss[0], loss


def run_cli(tmp_path, *extra, out="out"):
    out_dir = str(tmp_path / out)
    assert main([*TINY, "--out", out_dir, *extra]) == 0
    with open(os.path.join(out_dir, "report.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "ddp"],
        ["--method", "sdp", "--level", "block", "--regime", "forward"],
        ["--method", "sdp", "--level", "neuron", "--regime", "backward"],
    ],
    ids=["ddp", "sdp-block-forward", "sdp-neuron-backward"],
)
def test_each_method_end_to_end(tmp_path, extra):
    report = run_cli(tmp_path, *extra)
    assert report["world_size"] == 2 and report["steps"] == 6
    assert len(report["history"]["loss"]) == 6
    assert_learned(report)
    assert all(r["memory"]["model_state"] > 0 for r in report["per_rank"])
    assert report["comm"]["bytes_per_step"] > 0
    for name in ("report.json", "report.md", "loss.png", "memory.png"):
        assert os.path.getsize(tmp_path / "out" / name) > 0
    if extra[1] == "sdp":
        assert "ensemble" in report["final"]


def test_fsdp_end_to_end(tmp_path):
    # FSDP2 (fully_shard) runs on CPU with gloo since torch 2.6; only its absence is a skip.
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)")
    report = run_cli(tmp_path, "--method", "fsdp")
    assert report["method"] == "fsdp" and report["comm"]["source"].startswith("predicted")
    assert report["world_size"] == 2 and len(report["history"]["loss"]) == 6
    assert_learned(report)
    assert all(r["memory"]["model_state"] > 0 for r in report["per_rank"])


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    common = ["--method", "sdp", "--level", "block", "--save-every", "2"]
    whole = run_cli(tmp_path, *common, "--save-dir", str(tmp_path / "ck_whole"), out="whole")
    # Interrupted after 4 steps, then resumed from the step-4 checkpoint.
    assert main([*TINY, *common, "--save-dir", str(tmp_path / "ck"), "--stop-after", "4",
                 "--out", str(tmp_path / "first")]) == 0
    assert (tmp_path / "ck" / "LATEST").read_text() == "step-000004"
    resumed = run_cli(tmp_path, *common, "--save-dir", str(tmp_path / "ck"), "--resume", out="resumed")
    assert resumed["history"]["loss"] == pytest.approx(whole["history"]["loss"], rel=1e-6, abs=1e-7)
    a = torch.load(tmp_path / "ck_whole" / "step-000006" / "model.pt")
    b = torch.load(tmp_path / "ck" / "step-000006" / "model.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


BAD_ARGS = [
    (["--sync-every", "units=x"], "'units=x' is not GROUP=INT"),
    (["--sync-every", "units=0"], "needs a group name and a period >= 1"),
    (["--sync-every", "4", "--method", "sdp", "--assignment", "redraw", "--reassign-every", "6"],
     "--reassign-every 6 must be a multiple of --sync-every's longest period 4"),
    (["--sync-every", "shared=1,units=4", "--method", "sdp", "--assignment", "redraw", "--reassign-every", "6"],
     "--reassign-every 6 must be a multiple of --sync-every's longest period 4"),
    (["--coverage", "0"], "--coverage must be in"),
    (["--coverage", "1.5"], "--coverage must be in"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--resume"], "--resume needs --save-dir"),
    (["--data", "cifar:/nonexistent/cifar"], "does not exist"),
    (["--data", "tokens:/nonexistent/x.bin", "--model", "llama"], "does not exist"),
    (["--method", "zero"], "invalid choice"),
    (["--grad-clip", "0"], "--grad-clip must be positive and finite, got 0.0"),
    (["--grad-clip", "nan"], "--grad-clip must be positive and finite"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--warmup-steps", "5", "--steps", "5"], "--warmup-steps 5 must be less than --steps 5"),
    (["--precision", "fp8"], "invalid choice"),
    (["--lr-schedule", "linear"], "invalid choice"),
    (["--model", "transformer"], "invalid choice"),  # gpt is a model now
    (["--model", "hf:/nonexistent"], "config.json' does not exist"),
    (["--level", "layer"], "invalid choice"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be positive"),
    (["--simulate-rank", "1"], "--simulate-rank R and --world-size K go together"),
    (["--simulate-rank", "4", "--world-size", "4"], "--simulate-rank must be in [0, --world-size)"),
    (["--simulate-rank", "0", "--world-size", "4", "--method", "ddp"], "--simulate-rank applies to --method sdp"),
    (["--simulate-rank", "0", "--world-size", "4", "--nproc", "2"], "--simulate-rank runs one process"),
    (["--simulate-rank", "0", "--world-size", "4", "--save-dir", "x"], "cannot write checkpoints"),
    (["--simulate-rank", "0", "--world-size", "4", "--verify-every", "2"], "drop --verify-every"),
    # SDP options given to another method are refused, not ignored.
    (["--method", "ddp", "--coverage", "0.25"], "--coverage 0.25: SDP option(s), but --method ddp trains the whole"),
    (["--method", "fsdp", "--level", "neuron", "--no-overlap"], "--level neuron, --no-overlap: SDP option(s), but "
                                                                 "--method fsdp"),
    (["--coverage", "half"], "--coverage takes a number in (0, 1] or a comma-separated list of them, got 'half'"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS)
def test_bad_arguments(argv, message, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        check_args(parser, parser.parse_args(argv))
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_data_folder_is_a_clear_error(tmp_path):
    folder = tmp_path / "cifar"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"not a pickle")
    with pytest.raises((ValueError, FileNotFoundError), match="cifar|data_batch"):
        main(["--model", "mlp", "--data", f"cifar:{folder}", "--steps", "1", "--nproc", "1"])


def test_model_data_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="needs token data"):
        main(["--model", "llama", "--data", "digits", "--steps", "1", "--nproc", "1"])


def test_console_entry_point_runs_as_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "subnet_ext.cli.train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--coverage" in out.stdout
    # A user's help: what the command does first (not a developer docstring), `compare`, and defaults.
    description = out.stdout.split("\n\n")[1]
    assert description.startswith("Train a model with Subnetwork Data Parallelism"), description
    assert "subnet-train compare" in out.stdout
    flat = " ".join(out.stdout.split("options:", 1)[1].split())  # the options, after the usage line
    for option, default in (("--steps STEPS optimizer steps", "300"), ("--lr LR AdamW learning rate", "0.003"),
                            ("--batch-size BATCH_SIZE examples per rank per micro-batch", "32"),
                            ("--coverage COVERAGE fraction of ranks owning each unit", "0.5"), ("--seed SEED seed of", "0")):
        assert option in flat and flat.split(option, 1)[1].split("--", 1)[0].rstrip().endswith(
            f"(default: {default})"), option
    assert "(default: None)" not in flat and "(default: False)" not in flat


def test_simulated_rank_end_to_end(tmp_path):
    """Rank 1 of a 4-rank SDP job in this one process: its batches, its subnetwork's
    evaluation, and the bytes its collectives would have handed over."""
    out = tmp_path / "sim"
    assert main(["--model", "mlp", "--data", "digits", "--steps", "4", "--batch-size", "16", "--simulate-rank", "1",
                 "--world-size", "4", "--level", "neuron", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["simulated"] == {"rank": 1, "world_size": 4}
    assert set(report["final"]) == {"subnetwork"}
    assert report["comm"]["simulated"] and report["comm"]["bytes_per_step"] == report["comm"]["predicted_per_sync"]["bytes"]


def test_a_period_per_group_from_the_command_line(tmp_path):
    """--sync-every shared=1,units=2 reaches the engine as SDPConfig.sync_every's mapping: the shared
    parameters' gradients are averaged every step, the units' parameters every second step."""
    report = run_cli(tmp_path, "--method", "sdp", "--level", "block", "--coverage", "1",
                     "--sync-every", "shared=1,units=2")
    assert report["sdp"]["sync_every"] == {"shared": 1, "units": 2}
    counted = report["comm"]["by_quantity"]  # [bytes, collectives] per quantity, counted by the communicator
    assert counted["gradients"][1] == 6 and counted["parameters"][1] == 3, counted  # 6 steps: every step, every 2nd

