"""The corrected behaviour, next to every era: W3's frames plus what TensorRT-LLM lacks. The gen validates the
ctx's RankInfo before it registers, on every field the ctx compares and the KV dtype itself (T73: only
element_bytes travels), and fails the request at once naming the field; the ctx answers a registration it refuses;
the completion travels with the WRITE as its NIXL notification (the trtllm#17665 proposal), so a lost result frame
loses nothing; and every wait has a deadline that fails the request naming what it waited for."""

from msgspec.structs import replace

from pdcheck.releaseline import CORRECTED
from pdcheck.trtllm.eras import w3

MODEL = replace(
    w3.MODEL, name=CORRECTED, era="corrected", releases="", wire="corrected", checks="corrected", gate=True,
    listener="logs", dated="", summary="told at once, a deadline on every wait, completion bound to the WRITE",
    facts=("T70", "T73", "T61"),
)
