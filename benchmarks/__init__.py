"""Benchmarks of beamline: serving against baselines on one machine, and the engine's own costs.

Each `python -m benchmarks.NAME` is `benchmarks/NAME.py`; see benchmarks/README.md (Layout) for
which module holds what.
"""
