"""pdcheck: reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures."""

__version__ = "0.1.0"
