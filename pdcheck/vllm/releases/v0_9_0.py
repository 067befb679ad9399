"""vLLM 0.9.0: one handshake with the same rank's port; only the engine-id conflict guard."""

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Action, Check, ReleaseModel

MODEL = ReleaseModel(
    name="0.9.0",
    versions=("0.9.0",),
    wire="A",
    flow="same_rank",
    tp_size_from="params",  # 0.9.0 has no heterogeneous TP: tp_ratio is always 1
    recv_timeout_ms=None,
    pre_add=(),
    add_remote=(
        Check("engine_id_conflict", "engine_id != self.engine_id",
              lambda c: c.engine_id != c.local.engine_id, message="Conflict engine id found!", hazard="H19"),
        # 0.9.0 knows no heterogeneous TP: every D rank reads the same rank, tp_ratio is 1.
        Action("assume_same_tp", lambda c: c.state.tp_size.setdefault(c.engine_id, c.local.tp_size)),
        rules.NIXL_ADD,
        Action("record_dst_num_blocks", lambda c: c.state.dst_num_blocks.__setitem__(c.engine_id, c.meta.num_blocks)),
        rules.prep_if_target(with_replication=False, device="local_rank"),
    ),
    notif="{req}",
    dp_engine_suffix=False,  # every DP rank's engine keeps the configured id
    summary="per-rank ports, same-rank handshake, no metadata checks beyond the engine-id conflict",
)
