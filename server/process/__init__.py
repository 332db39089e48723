"""The engine in a process of its own: the HTTP front end keeps its process (event loop, SSE
framing, tokenization), the engine steps in another with its own GIL (vLLM V1's EngineCore,
SGLang's scheduler process). messages.py: what crosses the pipe; worker.py: the engine process;
client.py: the front end's EngineClient over it."""
