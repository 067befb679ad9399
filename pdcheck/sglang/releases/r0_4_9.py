"""SGLang 0.4.9.post2 (R3): registration ("None" room, 8 fields) split from a 7-field request with int32 page
indices (E3; R3 nixl/conn.py:53-89, 496-521). Bootstrap and checks as 0.4.7."""

from msgspec.structs import replace

from pdcheck.sglang.releases import r0_4_7

MODEL = replace(
    r0_4_7.MODEL, name="0.4.9.post2", tag="R3", versions=("0.4.9", "0.4.9.post2", "0.5.0"),
    wire="E3", split_registration=True, index_dtype="int32", room_reuse="keyerror",
    summary="registration split from the 7-field request, int32 indices, hetero TP asserts MLA-only",
)
