"""The parts of `python -m benchmarks.seq2seq`: random translation-shaped models, the workload, and
each system the benchmark runs (beamline over HTTP, CTranslate2, transformers' `generate()`)."""
