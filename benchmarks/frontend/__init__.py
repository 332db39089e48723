"""The parts of the front-end cost benchmark (`python -m benchmarks.frontend_cost`)."""
