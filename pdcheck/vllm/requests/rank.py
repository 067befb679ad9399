"""The request path's ranks on pdcheck's rank skeleton (pdcheck.ranks.run_rank): one entry point, the spec's role
picks P (pdcheck.vllm.requests.prefill) or D (pdcheck.vllm.requests.decode)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from pdcheck.ranks import Role, run_rank
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests.decode import RequestsD
from pdcheck.vllm.requests.prefill import RequestsP
from pdcheck.vllm.requests.role import RequestsRole


def requests_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(RequestsRank, conn, spec_bytes)


class RequestsRank(RequestsRole):
    @classmethod
    def for_spec(cls, spec: rm.ReqSpec) -> type[Role]:
        return RequestsP if spec.role == "P" else RequestsD
