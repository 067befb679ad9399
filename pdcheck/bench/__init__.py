"""`pdcheck transfer-bench`: a KV-shaped NIXL READ benchmark between real prefill and decode rank processes.

Modules, one concern each:
  models     model presets and KV shapes (GQA and MLA)
  layout     per-rank geometry, seeded block tables, descriptor arrays (vLLM layout)
  pattern    the logical-coordinate fill pattern and the #wrong check
  buffers    host (private mmap + numpy, THP) and GPU (torch, lazily imported) KV pools
  measure    timed loops: KV rows, the memcpy ceiling, the one-descriptor wire ceiling
  transport  transport presets, UCX_PROTO_INFO parsing, diagnosis warnings
  envinfo    host facts, versions, and the foreign-CPU (disturbance) meter
  protocol   msgspec control messages between the parent and the ranks
  rank       the rank process (P = target, D = initiator)
  plan       configuration and sweep plan, validated before any process starts
  procs      spawns, pins, talks to and reaps the rank processes
  runner     drives a run and aggregates decode ranks into rows
  schema     the msgspec output document
  output     rich table, JSON/JSONL/CSV, plot
  command    the typer command and exit codes

Nothing here imports torch unless --device cuda is asked for.
"""
