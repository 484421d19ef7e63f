"""What `subnet-train` shows while it trains: rank 0 writes a line every --log-every steps and
one per evaluation, and on a terminal keeps a tqdm progress bar below them.

    step 20/300 | loss 2.3456 | 5,210 tokens/s | lr 0.003
    eval at step 50: full loss 2.2011, ensemble loss 2.2490

Lines go to stderr (the report table of a finished run goes to stdout), through
`tqdm.write`, so a bar on the terminal stays below them. The loss is rank 0's training loss,
the mean over the steps since the previous line (read when the loop reads the history, so
printing adds no read of its own); the throughput counts every rank's examples (tokens for a
language model), micro-batches included, over the wall time since the previous line.
"""
from __future__ import annotations

import contextlib
import sys
import time

_clock = time.perf_counter  # seconds; a module attribute so that a test can replace it


def metrics_text(metrics: dict, task_type: str) -> str:
    """'full loss 2.2011, ensemble loss 2.2490' (a classifier: 'full accuracy 61.25% (loss 1.0712), ...') of one
    evaluation {mode: {"loss", "accuracy"}}, the full model first."""
    parts = []
    for mode in sorted(metrics, key=lambda m: (m != "full", m)):  # the full model first
        m = metrics[mode]
        if task_type == "classification" and "accuracy" in m:
            parts.append(f"{mode} accuracy {100 * m['accuracy']:.2f}% (loss {m['loss']:.4f})")
        else:
            parts.append(f"{mode} loss {m['loss']:.4f}")
    return ", ".join(parts)


class TrainingProgress:
    """Rank 0's progress lines and bar; on every other rank it does nothing.

    Args:
        rank: this process's rank. start, total: the first step to take (a resumed run's) and
            --steps. examples_per_step: examples (tokens for a language model) all ranks
            consume in one optimizer step. unit: "tokens" or "samples". task_type:
            "language" or "classification" (what an evaluation line shows).
        stream: where lines go (default sys.stderr); the bar only when it is a terminal.
    """

    def __init__(self, rank: int, start: int, total: int, examples_per_step: int, unit: str, task_type: str,
                 stream=None):
        from tqdm import tqdm

        self.on = rank == 0
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.per_step, self.unit, self.task_type = total, examples_per_step, unit, task_type
        self.logged_step, self.logged_at = start, _clock()
        terminal = self.on and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=total, initial=start, disable=not terminal, desc="train", leave=False,
                        dynamic_ncols=True, mininterval=0.5, file=self.stream)

    def _write(self, line: str) -> None:
        if self.on:
            self.bar.write(line, file=self.stream)
            self.stream.flush()

    @contextlib.contextmanager
    def paused(self):
        """Leave the time inside out of the throughput (an evaluation, a checkpoint save)."""
        began = _clock()
        try:
            yield
        finally:
            self.logged_at += _clock() - began

    def step_done(self) -> None:
        """One optimizer step taken: the bar advances."""
        self.bar.update(1)

    def log(self, step: int, history: dict) -> None:
        """A line for the steps since the previous one (their losses read into `history`)."""
        if not self.on or step <= self.logged_step:
            return
        now = _clock()
        steps = step - self.logged_step
        losses = [v for s, v in zip(history["step"][-steps:], history["loss"][-steps:]) if s > self.logged_step]
        rate = steps * self.per_step / max(now - self.logged_at, 1e-9)
        skipped = sum(1 for s in history.get("skipped", []) if s > self.logged_step)
        line = (f"step {step}/{self.total} | loss {sum(losses) / max(len(losses), 1):.4f} | "
                f"{rate:,.0f} {self.unit}/s | lr {history['lr'][-1]:.3g}")
        if skipped:
            line += f" | {skipped} step(s) skipped (inf/NaN gradients)"
        self.logged_step, self.logged_at = step, now
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}" if losses else "n/a", refresh=False)
        self._write(line)

    def evaluation(self, step: int, metrics: dict, final: bool = False) -> None:
        """A line for an evaluation at `step` ({mode: {"loss", "accuracy"}}); run it `paused()`."""
        what = "final evaluation" if final else "eval"
        self._write(f"{what} at step {step}: {metrics_text(metrics, self.task_type)}")

    def note(self, line: str) -> None:
        """Any other line rank 0 has to say (a resumed run, ...)."""
        self._write(line)

    def close(self) -> None:
        """Remove the bar (the lines stay)."""
        self.bar.close()
