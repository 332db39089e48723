"""The parts of the serving benchmark (`python -m benchmarks.serve`): its options, the servers under
test, the baselines, the JSON while the run goes on, the report and the plot, and the two
single-server cases (beam search, structured outputs)."""
