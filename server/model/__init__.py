"""The model side: loading, weight layouts and quantization, paged attention, the model runner."""
