"""vLLM NixlConnector side-channel wire formats, per era, as data."""

from pdcheck.vllm.wire.formats import (
    FORMATS,
    GET_META_MSG,
    WireError,
    WireFormat,
    encode_reply,
    encode_request,
    parse_request,
    parse_stage,
    strict_decode,
    tolerant_decode,
)
from pdcheck.vllm.wire.schemas import AnyMeta

__all__ = [
    "FORMATS", "GET_META_MSG", "AnyMeta", "WireError", "WireFormat", "encode_reply", "encode_request",
    "parse_request", "parse_stage", "strict_decode", "tolerant_decode",
]
