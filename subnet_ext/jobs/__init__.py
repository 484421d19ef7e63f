"""Training jobs: what `subnet-train` runs, as a public API the study and the benchmarks share.

A job is a task (model and data, `tasks.py`), a method that trains it (torch DDP, FSDP2 or SDP,
`methods.py`, each measuring what it costs), the optimizer step's settings (`training.py`:
precision, clipping, schedule, accumulation, activation checkpointing; `stochastic_depth.py`),
the loop (`loop.py`, with its progress lines in `progress.py`), its checkpoints and resuming
(`run_checkpoints.py`), fault injection for tests (`faults.py`), the launch of worker
processes (`launch.py`, `runner.py`) and the report (`report.py`). The command line
(`subnet_ext.cli`) parses arguments (`arguments.py`) and calls these.
"""
