"""Benchmarks, grouped by what they measure (bench/README.md lists every entry point).

Run each as a module from the repository root, e.g. ``.venv/bin/python -m
bench.transport.env_throughput --help``, so ``bench`` and the project's packages import without
any sys.path edits. Results go to bench/results/<name>.json. Not part of the installed package.
"""
