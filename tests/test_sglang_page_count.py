"""SGLang's last two details (issue #37): a page-size mismatch at the same page count per request delivered as each
release delivers it (P's page-count assert passes, P writes by its own page size, D reads every row wrong with no
error: silent, proven by the transfer proof; refused at bootstrap from 0.5.8), and the exact `Decode ... failed for
request` line a request ends with (releases.base.DECODE_FAILED, read in decode.py of 0.4.7 - 0.5.23)."""

from __future__ import annotations

import json

import pytest

from pdcheck import cli
from pdcheck.sglang.engine import Side, decide, decode_failed, ensure_failed
from pdcheck.sglang.releases import resolve


def test_the_page_count_decides_between_ps_assert_and_a_silent_write() -> None:
    p, d = Side(page_size=16), Side(page_size=32)
    rel = resolve("0.4.9.post2")
    # 4 pages of 16 on P are 2 pages of 32 on D: P's assert (D offered fewer), nothing written, D waits
    assert decide(rel, rel, p, d, 0, p_pages=4).status == "hang"
    # 1 page on both sides: the assert passes and P writes by its own page size
    v = decide(rel, rel, p, d, 0, p_pages=1)
    assert v.status == "silent" and "its own kv_item_len" in v.message
    assert decide(resolve("0.5.8"), resolve("0.5.8"), p, d, 0, p_pages=1).status == "error"


def test_same_page_count_scenario_is_silent_on_real_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.run(["handshake", "sglang-page-size-same-count", "--sglang", "0.4.9.post2,0.5.3,0.5.8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    by = {p["release"]: p for p in doc["pairs"]}
    for rel in ("0.4.9.post2", "0.5.3"):
        pair = by[rel]
        assert [v["status"] for v in pair["observed"]] == [v["status"] for v in pair["model"]] == ["silent"]
        t = pair["transfers"][0]  # the proof: every page of both requests holds what P never meant there
        assert t["status"] == "wrong" and t["wrong"] == t["blocks"] == 8, t  # 2 requests x 1 page x 4 regions
        assert pair["observed"][0]["exception"] is None  # no error anywhere: NIXL reports DONE
    assert [v["status"] for v in by["0.5.8"]["observed"]] == ["error"]
    assert "Page size mismatch: prefill server has page_size=16" in by["0.5.8"]["observed"][0]["message"]


def test_the_decode_failed_line_exactly() -> None:
    # the bootstrap queue's line after the parallel info could not be fetched (0.5.13+: the reason recorded)
    v = ensure_failed(resolve("0.5.13"), "127.0.0.1:8998", 1000, "HTTP 503", 1)
    assert v.message.endswith("Decode handshake failed for request rank=1 decode_req.req.rid='<rid>' "
                              "decode_req.req.bootstrap_room=1000 with exception KVTransferError(bootstrap_room=1000): "
                              "Aborted by AbortReq.")
    # 0.5.10 - 0.5.12: the receiver's RuntimeError, str() of it its message alone
    v = ensure_failed(resolve("0.5.10"), "127.0.0.1:8998", 1000, "HTTP 503")
    assert v.message.endswith("decode_req.req.bootstrap_room=1000 with exception NIXL KVReceiver Exception")
    assert decode_failed("transfer", 0, 7, "Exception: Fake KVReceiver Exception") == (
        "Decode transfer failed for request rank=0 decode_req.req.rid='<rid>' decode_req.req.bootstrap_room=7 with "
        "exception Fake KVReceiver Exception")
