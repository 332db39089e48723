"""beamline: an OpenAI-compatible inference server with continuous batching."""
