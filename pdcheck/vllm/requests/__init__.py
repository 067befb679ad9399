"""`pdcheck requests`: the request lifecycle after the handshake: lines (each release line's request
path as data), faults (--fault parsing), model (D's decisions, P's block accounting simulated), run (real P and D
ranks, real NIXL READs and notifications) and command (the CLI)."""
