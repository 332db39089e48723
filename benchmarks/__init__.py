"""Serving benchmark: beamline (or any OpenAI-compatible server) against HF and llama.cpp baselines.

Run `python -m benchmarks.serve --help`; see benchmarks/README.md.
"""
