"""`pdcheck transfer-bench`: a KV-shaped NIXL READ benchmark between real prefill and decode rank processes.

Modules, one concern each:
  command    the typer command and exit codes
  plan       configuration and sweep plan, validated before any process starts
  models     model presets and the KV shape a rank holds (GQA and MLA)
  tables     seeded block tables and vLLM's descriptor ids over them
  runner     drives a run: start ranks (pdcheck.launcher), sweep the rows, stop, diagnose, summarise
  rank       the rank body (P = target, D = initiator), over pdcheck's KV cache, pattern and agent wrapper
  measure    timed loops on the decode rank and the statistics derived from them
  transport  transport presets, UCX_PROTO_INFO parsing, diagnosis warnings
  envinfo    host facts, versions, and the foreign-CPU (disturbance) meter
  schema     the msgspec output document
  output     rich table, JSON/JSONL/CSV, plot
Messages to and from the ranks are pdcheck.messages'; the KV geometry is pdcheck.geometry's.

Nothing here imports torch unless --device cuda is asked for.
"""
