"""TensorRT-LLM's disaggregated KV-cache transceivers over NIXL, the third serving framework.

A context (prefill, "ctx") rank WRITEs its KV blocks into a generation (decode, "gen") rank: the Python
transceiver ("V2") over ZMQ control frames and one-sided NIXL WRITEs, in the wire eras W1a ... W3; the C++
transceiver ("V1") over NIXL notifications, in the release eras E1 ... E4. Era models as data (eras/), the layout
arithmetic (layout), the wire codecs (wire, cppwire), the checks (checks), the pure verdict engine (engine), the
fake ranks on pdcheck's one runtime (pool, ctx, gen, cpp, runner), and the commands (report, smoke, probe, serve,
doctor). Facts: docs/trtllm-protocol.md (T1 ... T79); what is modelled: docs/trtllm.md.
"""
