"""The documentation site's reference pages, generated from the code so that they cannot drift.

`python -m server.docgen` rewrites every generated block of docs/ (the text between a block's two
marker comments: request fields from the pydantic request models, configuration keys and CLI
flags from `ServerConfig` and the real `beamline` argument parser, Prometheus metrics from the
registry, routes from the FastAPI app); `python -m server.docgen --check` only says which pages
are stale. tests/test_docs_reference.py fails while a page is stale or while a field, key, flag,
metric or route of the code is missing from the docs. Nothing here runs when the server serves.
"""
