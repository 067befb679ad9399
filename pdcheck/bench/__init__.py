"""`pdcheck transfer-bench`: a KV-shaped NIXL READ benchmark between real prefill and decode rank processes.

Modules, one concern each (the KV cache, its pattern and check, the NIXL agent wrapper, the model shape and
the bounds are pdcheck's own, shared with `pdcheck handshake`):
  command    the typer command: flags -> BenchConfig -> run -> report -> exit code
  plan       configuration and sweep plan, checked (pdcheck.bounds) before any process starts
  models     model presets resolved into a pdcheck.geometry.ModelShape
  tables     seeded per-request block tables
  rank       the rank process (P = target, D = initiator)
  measure    ceilings (memcpy, one-descriptor wire), the per-request check, latency statistics
  runner     drives a run on pdcheck's launcher and aggregates decode ranks into rows
  transport  transport presets, UCX_PROTO_INFO parsing, diagnosis warnings
  envinfo    host facts, versions, and the foreign-CPU (disturbance) meter
  schema     the msgspec output document
  output     rich table, JSON/JSONL/CSV, plot
Messages to and from the ranks are pdcheck.messages'; the KV geometry is pdcheck.geometry's.

Nothing here imports torch unless --device cuda is asked for.
"""
