"""E2, TensorRT-LLM 1.0-1.1: the C++ transceiver only; CacheTransceiverConfig{backend, max_tokens_in_buffer,
kv_transfer_timeout_ms=None} (T4): the setting exists, its default bounds nothing. Notification protocol and
inquireSupport as E1."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import e1

MODEL = replace(
    e1.MODEL, name="E2", era="E2", releases="1.0-1.1",
    timeout_source="kv_transfer_timeout_ms default None (T4)",
    dated="1.0 by tensorrt_llm/version.py@000a01de (1.0.0rc4, T3) and the stored llm_args.py (T4)",
    summary="C++ over NIXL notifications, kv_transfer_timeout_ms default None",
)
