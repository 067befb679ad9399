"""E4, TensorRT-LLM 1.3.0rc: the C++ transceiver by default (the Python one opt-in, then `auto`: the W lines),
kv_transfer_timeout_ms = 60000 from trtllm#12249 (merged 2026-03-18; which 1.3.0rc first carries it is not
established). The executor cancels a transfer that outlives it (T66), but the gen's wait for the completion
notification is still unbounded: trtllm#17665 (open) reports the hang on 1.3.0rc0-rc24 (T61, §8)."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import e1

MODEL = replace(
    e1.MODEL, name="E4", era="E4", releases="1.3.0rc",
    transfer_timeout_ms=60000, timeout_source="kv_transfer_timeout_ms = 60000 (trtllm#12249, merged 2026-03-18)",
    dated="1.3.0rc by trtllm#12249 (2026-03-18), trtllm#18134 (2026-08-24) and the 1.3.0rc27 docs (T5-T7)",
    summary="C++ default, 60 s transfer timeout; completion wait still unbounded (trtllm#17665)",
)
