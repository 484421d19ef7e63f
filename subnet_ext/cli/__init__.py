"""Command line: `subnet-train` (training, comparison, launch) and `subnet-plan`."""
