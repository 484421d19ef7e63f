"""Data that needs no download: scikit-learn's bundled digits, local CIFAR-10 and token
files, and a synthetic token source with a known entropy rate."""
