"""The study: which method to train with, on nanoGPT's Tiny Shakespeare benchmark (bench/README.md).

    python -m bench.study            # `make study`
    python -m bench.study --quick    # its short form (CI)

One module per concern: profiles and the run list (runs.py), one training run (training.py),
the ranks' loop over the jobs (worker.py), what is measured besides the loss (measure.py),
evaluation of every model a user could keep (evaluation.py), statistics (stats.py), the
results as the tables read them (results.py), every comparison (analysis.py), the decision
and the generated blocks (decision.py), the report (report.py, verdict.py, plots.py).
"""
