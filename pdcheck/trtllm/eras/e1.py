"""E1, TensorRT-LLM 0.20-0.21 (2025): the C++ transceiver only, NIXL selected by TRTLLM_USE_NIXL_KVCACHE=1 and
then cache_transceiver_config.backend (reference §1.2; the E1 facts were not re-checked, docs/trtllm-protocol.md
§11). No kv_transfer_timeout_ms yet: nothing bounds a transfer. The notification protocol and inquireSupport are
modelled as read at 1.2.0rc2 and at the index's current cacheFormatter.cpp (T56-T64): older formatters without
the dtype check exist in the index without a commit and are not modelled."""

from pdcheck.trtllm.eras.base import TrtLine

MODEL = TrtLine(
    name="E1", era="E1", releases="0.20-0.21", runtime="cpp", wire="cpp", checks="inquire",
    transfer_timeout_ms=None, timeout_source="no kv_transfer_timeout_ms in 0.20-0.21",
    dated="0.20-0.21 by pull-request dates (trtllm#4125 2025-05-07, #5234 2025-06-19); not re-checked",
    summary="C++ over NIXL notifications, no transfer deadline", facts=("T56", "T58", "T59", "T61", "T62", "T64"),
)
