"""Benchmarks and peer comparisons (issue #3); never imported by the package."""
