"""The continuous-batching engine: scheduler, paged KV cache, model runner."""
