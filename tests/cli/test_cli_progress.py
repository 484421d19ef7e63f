"""A command line that talks: subnet-train's progress and evaluation lines (and a bar on a
terminal), report columns only for comparisons that were run, a finished run resumed says so,
every option of subnet-train, subnet-train compare and subnet-plan shows its default.

The runs are one process in this process (mlp on digits, a few steps)."""
import argparse
import io
import json
import os
import re

import pytest

from subnet_ext.cli import compare, plan
from subnet_ext.jobs import progress
from subnet_ext.jobs.report import markdown_table
from subnet_ext.cli.train import build_parser, main

TINY = ["--model", "mlp", "--width", "16", "--data", "digits", "--batch-size", "16", "--nproc", "1"]


@pytest.fixture(scope="module")
def talked(tmp_path_factory):
    """One run of 6 steps logging every 2 and evaluating every 3, saving its checkpoints:
    (its report, its stderr, its stdout, the checkpoint folder)."""
    tmp = tmp_path_factory.mktemp("talk")
    capture = pytest.MonkeyPatch()
    err, out = io.StringIO(), io.StringIO()
    capture.setattr("sys.stderr", err)
    capture.setattr("sys.stdout", out)
    try:
        code = main([*TINY, "--steps", "6", "--log-every", "2", "--eval-every", "3", "--out", str(tmp / "out"),
                     "--save-dir", str(tmp / "ck")])
    finally:
        capture.undo()
    assert code == 0, err.getvalue()
    report = json.loads((tmp / "out" / "report.json").read_text())
    return report, err.getvalue(), out.getvalue(), tmp / "ck"


def test_progress_and_evaluation_lines(talked):
    """A line at steps 2, 4 and 6 with the mean of that window's losses as the report's history
    has them, and a line per evaluation with the values the report recorded."""
    report, err, _, _ = talked
    history = report["history"]
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    for line, end in zip(lines, (2, 4, 6)):
        window = history["loss"][end - 2:end]
        loss = float(re.search(r"loss (\d+\.\d+)", line).group(1))
        assert loss == pytest.approx(sum(window) / 2, abs=5e-5), (line, window)
        assert float(re.search(r"\| ([\d,]+) samples/s", line).group(1).replace(",", "")) > 0
    evals = {e["step"]: e for e in history["eval"]}
    assert sorted(evals) == [3, 6]
    for step, label in ((3, "eval"), (6, "final evaluation")):
        line = next(line for line in err.splitlines() if line.startswith(f"{label} at step {step}:"))
        assert f"full accuracy {100 * evals[step]['full']['accuracy']:.2f}%" in line, line
        assert f"(loss {evals[step]['full']['loss']:.4f})" in line, line


def test_throughput_counts_every_rank_and_leaves_pauses_out(monkeypatch):
    """tokens/s = steps x examples per step / the wall time since the previous line, less the
    time spent paused (an evaluation); rank 1 writes nothing; a terminal gets a bar, a log none."""
    clock = iter([0.0, 1.0, 3.0, 4.0])
    monkeypatch.setattr(progress, "_clock", lambda: next(clock))
    stream = io.StringIO()
    shown = progress.TrainingProgress(0, 0, 10, examples_per_step=2 * 4 * 64, unit="tokens", task_type="language",
                                      stream=stream)  # at t = 0
    history = {"step": [1, 2], "loss": [3.0, 2.0], "lr": [1e-3, 1e-3], "skipped": [2]}
    with shown.paused():  # t = 1 .. 3: two seconds left out
        pass
    shown.log(2, history)  # t = 4: 2 steps x 512 tokens in 4 - 2 = 2 s
    assert stream.getvalue().strip() == ("step 2/10 | loss 2.5000 | 512 tokens/s | lr 0.001 | 1 step(s) skipped "
                                         "(inf/NaN gradients)")
    assert shown.bar.disable  # not a terminal
    monkeypatch.undo()
    silent = io.StringIO()
    other = progress.TrainingProgress(1, 0, 10, 512, "tokens", "language", stream=silent)
    other.log(2, history)
    other.evaluation(2, {"full": {"loss": 1.0}})
    assert silent.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    with_bar = progress.TrainingProgress(0, 0, 10, 512, "tokens", "language", stream=terminal)
    assert not with_bar.bar.disable
    with_bar.close()


def _compared(report: dict, label: str, scale: float) -> dict:
    """A copy of `report` relabelled, with its step time and memory scaled by `scale` and no
    ensemble (as a DDP run's)."""
    other = json.loads(json.dumps(report))
    other["label"], other["step_time_s"] = label, report["step_time_s"] * scale
    other["final"].pop("ensemble")
    for r in other["per_rank"]:
        r["memory"] = {k: v * scale if isinstance(v, (int, float)) else v for k, v in r["memory"].items()}
    return other


def test_report_columns_only_for_comparisons_that_were_run(talked):
    report = talked[0]
    alone = markdown_table([report], baseline_label=report["label"]).splitlines()[0]
    assert "Δ" not in alone and "×" not in alone and "(ensemble)" in alone
    ddp = _compared(report, "ddp", 2.0)
    assert "(ensemble)" not in markdown_table([ddp], baseline_label="ddp").splitlines()[0]
    table = markdown_table([ddp, report], baseline_label="ddp").splitlines()
    head = [h.strip() for h in table[0].strip("|").split("|")]
    assert head.count("×ddp") == 3 and "Δ vs ddp" in head and "test acc (ensemble)" in head
    row = dict(zip(head, [c.strip() for c in table[3].strip("|").split("|")]))
    # The sdp row against a "ddp" run with twice its step time and memory: ratios of 0.5.
    step_ratio = head.index("step ms") + 1
    assert row["run"] == report["label"] and table[3].strip("|").split("|")[step_ratio].strip() == "0.500"
    assert row["×ddp"] == "0.500" and row["Δ vs ddp"] == "+0.00 pp"


def test_a_finished_run_resumed_says_so(talked, tmp_path, capsys):
    """Resuming the finished 6-step run with --steps 6 trains nothing, prints no table of n/a,
    writes nothing, and says that the run finished, with its final evaluation."""
    ck = talked[3]
    before = {name: os.path.getmtime(os.path.join(ck, name)) for name in os.listdir(ck)}
    assert main([*TINY, "--steps", "6", "--save-dir", str(ck), "--resume", "--out", str(tmp_path / "again")]) == 0
    captured = capsys.readouterr()
    assert "| run |" not in captured.out and "n/a" not in captured.out
    assert "already finished" in captured.err and "holds 6 optimizer steps (--steps 6)" in captured.err
    final = talked[0]["final"]["full"]
    assert f"full accuracy {100 * final['accuracy']:.2f}%" in captured.err
    assert {name: os.path.getmtime(os.path.join(ck, name)) for name in os.listdir(ck)} == before
    assert not (tmp_path / "again" / "report.json").exists()


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
            and a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("parser", [build_parser, compare.build_parser, plan.build_parser],
                         ids=["subnet-train", "subnet-train compare", "subnet-plan"])
def test_every_option_has_help_with_its_default(parser):
    """Each option's help line says what it does and its default (a flag is off by default)."""
    p = parser()
    formatter = p._get_formatter()
    for action in _options(p):
        text = formatter._expand_help(action) if action.help else ""
        assert len(text) > 10, action.option_strings
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            assert "default" in text, (action.option_strings, text)


def test_the_preset_help_lists_every_preset():
    from subnet_ext.models import GPT_PRESETS, LLAMA_PRESETS

    for p in (build_parser(), plan.build_parser()):
        text = next(a.help for a in p._actions if "--preset" in a.option_strings)
        assert all(name in text for name in (*GPT_PRESETS, *LLAMA_PRESETS)) and "deep" in text
