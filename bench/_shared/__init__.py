"""Helpers the benchmarks share (paths, machine facts, result files, venvs, LM services); no
benchmark here."""
