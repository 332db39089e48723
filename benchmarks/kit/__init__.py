"""The parts of the GPU kit (`python -m benchmarks.gpu_kit`)."""
