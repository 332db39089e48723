"""Encoder-decoder models in the paged, continuously batched step: the model's parts
(decoder.py) and the runner that encodes sources and decodes rows (runner.py)."""
