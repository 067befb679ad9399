"""vLLM's NixlConnector, modelled: its scenarios, release lines, wire eras, handshake and request path, and the
adapter (framework.py) the registry finds it by (docs/architecture.md)."""
