"""Benchmarks behind `ucm bench ...`: each reports ucm next to a baseline
measured in the same run."""
