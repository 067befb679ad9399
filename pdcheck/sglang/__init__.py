"""SGLang's NIXL disaggregation, the second serving framework.

The mirror image of vLLM: P runs an HTTP bootstrap server, D pushes its destinations to P over ZMQ, P WRITEs
into D. Release models (releases/), frames (wire), the bootstrap table (bootstrap), the pure verdict engine
(engine) and the fake ranks on pdcheck's one runtime (ranks, runner). Facts: docs/sglang-protocol.md.
"""
