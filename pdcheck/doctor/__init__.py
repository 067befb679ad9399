"""`pdcheck doctor`: can this node (or this pair of nodes) move KV with NIXL, and over which transport?

One module per concern: model (the check result and the exit rule), versions, plugins (NIXL backends),
netdevs (RDMA ports, NICs and GPUs from sysfs), envcheck (the environment rules), loopback (a real transfer
on this node through transfer-bench's runner), pair (the two-node transfer of --listen/--peer), run (every
check with its deadline), render (the table) and command (the typer command). docs/doctor.md.
"""
