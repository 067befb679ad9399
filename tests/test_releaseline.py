"""The one release-line type (pdcheck.releaseline) and the one kv_transfer_params keys table (releases.params):
parsing, ranges and error texts, and every phase reading the same keys for every release 0.9.0 - 0.34.x."""

from __future__ import annotations

import pytest

from pdcheck.errors import BadInput
from pdcheck.releaseline import ANY, CORRECTED, ReleaseTable, is_corrected, span, split_many, version_tuple
from pdcheck.sglang.releases import TABLE as SGLANG
from pdcheck.sglang.releases import resolve as sglang_resolve
from pdcheck.vllm.releases import CORRECTED as MODEL_CORRECTED
from pdcheck.vllm.releases import TABLE as VLLM
from pdcheck.vllm.releases import params, resolve, resolve_many
from pdcheck.vllm.requests import lines, push
from pdcheck.vllm.scenario import load
from pdcheck.vllm.serve import transfer_params

TOY: ReleaseTable[str] = ReleaseTable((
    ((1, 0, 0), (1, 0, 0), "a"),
    ((1, 0, 1), (1, 2, ANY), "b"),
    ((1, 3, 0), (1, 3, ANY), "c"),
), example="1.0.1", four_part=("1.2.3.4",))


def _stamp(x: str, name: str) -> str:
    return f"{x}@{name}"


def test_ranges_resolve_inclusively_and_stamp_the_release_typed() -> None:
    assert TOY.at((1, 0, 0)) == "a" and TOY.at((1, 0, 1)) == "b" and TOY.at((1, 2, 77)) == "b"
    assert TOY.at((1, 3, 9)) == "c" and TOY.at((0, 9, 9)) is None and TOY.at((1, 4, 0)) is None
    assert TOY.clamped((0, 1)) == "a" and TOY.clamped((9, 0)) == "c"
    assert TOY.resolve("v1.3", "--x", _stamp) == "c@1.3.0"
    assert TOY.resolve("1.1.0+cu128", "--x", _stamp) == "b@1.1.0"
    assert TOY.resolve("1.2.3.4", "--x", _stamp) == "b@1.2.3.4"
    assert TOY.resolve(" 1.0.1rc2 ", "--x", _stamp) == "b@1.0.1"


@pytest.mark.parametrize("text, says", [
    ("1.0", r"^--x: '1\.0' is ambiguous: 1\.0 spans release lines 1\.0\.0, 1\.0\.1 to 1\.2\.x \(name one, e\.g\. 1\.0\.0\)$"),
    ("1.0.1.1", r"^--x: release '1\.0\.1\.1' does not exist \(four-part releases: 1\.2\.3\.4; or name 1\.0\.1\)$"),
    ("2.0.0", r"^--x: release '2\.0\.0' is not modelled \(modelled: 1\.0\.0 to 1\.3\.x, corrected\); did you mean "
              r"'1\.0\.0'"),  # another major: not modelled, however new
    ("0.9.9", r"^--x: release '0\.9\.9' is not modelled \(modelled: 1\.0\.0 to 1\.3\.x, corrected\)"),
    ("x.1", r"^--x: 'x\.1' is not a release number \(ASCII digits, e\.g\. 1\.0\.1; modelled: 1\.0\.0 to 1\.3\.x"),
    ("\u0661.0.0", "is not a release number"),  # ASCII digits only
])
def test_bad_releases_are_one_line_errors(text: str, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        TOY.resolve(text, "--x", _stamp)


def test_a_minor_that_is_one_line_is_that_line() -> None:
    assert TOY.resolve("1.3", "--x", _stamp) == "c@1.3.0"
    assert TOY.resolve("1.2", "--x", _stamp) == "b@1.2.0"


def test_overlapping_or_unordered_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        ReleaseTable((((1, 0, 0), (1, 2, 0), "a"), ((1, 1, 0), (1, 3, 0), "b")))
    t = ReleaseTable.from_firsts([((0, 1, 0), "a"), ((0, 2, 5), "b"), ((1, 0, 0), "c")], last=(1, 0, ANY))
    assert [span(f, lt) for f, lt, _x in t.lines] == ["0.1.0 to 0.2.4", "0.2.5 to 0.x", "1.0.0 to 1.0.x"]


def test_lists_at_most_64_and_corrected_left_out() -> None:
    assert split_many("0.9.1,corrected, 0.14.0", "--vllm") == ["0.9.1", " 0.14.0"]
    with pytest.raises(BadInput, match=r"^--vllm: 65 releases named; at most 64 \(or 'all'\)$"):
        split_many(",".join(["0.9.1"] * 65), "--vllm")
    assert len(split_many(",".join(["0.9.1"] * 64 + ["corrected"]), "--vllm")) == 64
    with pytest.raises(BadInput, match="name at least one release"):
        resolve_many("corrected")


def test_version_helper_and_corrected() -> None:
    assert version_tuple("0.14.1") == (0, 14, 1) and version_tuple("0.10.1.1") == (0, 10, 1)
    assert version_tuple("0.4.6.post1") == (0, 4, 6) and version_tuple("v0.14") == (0, 14, 0)
    assert version_tuple(CORRECTED) > version_tuple("0.34.9")
    assert resolve("0.25.1").number == (0, 25, 1) and MODEL_CORRECTED.number > (0, 34, 0)
    for obj in (CORRECTED, MODEL_CORRECTED, lines.CORRECTED, lines.line_of(CORRECTED)):
        assert is_corrected(obj)
    assert not is_corrected(resolve("0.34.0")) and not is_corrected(lines.line_of("0.34.0"))


def test_vllm_and_sglang_use_the_one_table() -> None:
    assert resolve("0.14.1") is resolve("0.14.1") and resolve("0.14.1").name == "0.14.1"
    assert VLLM.at((0, 30, 2)).connector_version == resolve("0.30.0").connector_version
    assert sglang_resolve("0.4.6.post1").name == "0.4.6.post1" and SGLANG.at((0, 5, 14)).name == "0.5.13"
    with pytest.raises(BadInput, match=r"'0\.5' is ambiguous"):
        sglang_resolve("0.5")
    with pytest.raises(BadInput, match="runs beside every release"):
        sglang_resolve("corrected")


# ---- kv_transfer_params keys: one table, every phase
def _releases() -> list[str]:
    out = []
    for text in [*(f"0.{m}.0" for m in range(9, 35)), "0.9.1", "0.9.2", "0.10.1", "0.10.1.1", "0.11.1", "0.25.1"]:
        out.append(resolve(text).name)
    return sorted(set(out), key=lambda v: (version_tuple(v), v))  # version_tuple ties 0.10.1 and 0.10.1.1


@pytest.fixture(scope="module")
def scenario():  # type: ignore[no-untyped-def]
    return load(None, {"prefill": {"num_blocks": 100}, "decode": {"num_blocks": 100}})


@pytest.mark.parametrize("release", _releases())
def test_serve_and_requests_hand_out_the_same_keys(release: str, scenario) -> None:  # type: ignore[no-untyped-def]
    served = transfer_params(scenario, resolve(release), "h", 1, 4096)
    line = lines.line_of(release)
    assert tuple(served) == params.pull_keys(release) == line.keys
    assert push.keys(line) == params.push_keys(release)
    # the request path's line starts at or after every change of the keys below this release
    assert all(f <= line.first for f in params.changes() if f <= version_tuple(release))


def test_the_0_29_to_0_33_keys() -> None:
    """The keys read in the 0.29.0 - 0.33.0 wheels (pull_scheduler / push_scheduler request_finished)."""
    for release in ("0.29.0", "0.30.0", "0.31.0", "0.32.0"):
        assert {"dcp_size", "pp_size"} <= set(lines.line_of(release).keys)
        assert "remote_registration_generation" not in lines.line_of(release).keys
    assert "remote_registration_generation" in lines.line_of("0.33.0").keys
    assert "dcp_size" not in push.keys(lines.line_of("0.29.0")) and "dcp_size" in push.keys(lines.line_of("0.30.0"))
    assert [ln.line for ln in lines.LINES][-6:] == ["0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.33.0", "0.34.0"]
