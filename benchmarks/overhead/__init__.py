"""The parts of the engine host-time benchmark (`python -m benchmarks.engine_overhead`)."""
