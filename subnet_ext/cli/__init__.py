"""Command line: `subnet-train` (train.py; comparison in compare.py) and `subnet-plan` (plan.py).
What they run is subnet_ext.jobs."""
