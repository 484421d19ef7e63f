"""The project's benchmarks and its study (bench/README.md). A package so the study runs as
`python -m bench.study` from the repository's root and its ranks import it by name."""
