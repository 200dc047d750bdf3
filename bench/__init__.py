"""Benchmarks, ablations and probes of Studio (run each as ``python bench/NAME.py``); a package so that
the tests import its helpers as ``bench.NAME``."""
