"""Scenario loading: every bundled file loads and is sane; bad files raise BadInput naming file and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdcheck.errors import EXIT_BAD_INPUT, BadInput
from pdcheck.vllm.releases import resolve
from pdcheck.vllm.scenario import load

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
BUNDLED = sorted(SCENARIOS.glob("*.toml"))
NEEDED = {"seed-19338-tp8", "decode-fewer-blocks", "hetero-d4-p2", "hetero-p4-d2", "block-size-mismatch",
          "kv-heads-mismatch", "layout-mismatch", "attn-backend-mismatch", "mla",
          "cross-release-listener-death"}
MINIMAL = '[prefill]\nnum_blocks = 64\n[decode]\nnum_blocks = 64\n'


def test_the_needed_scenarios_are_bundled() -> None:
    assert NEEDED <= {p.stem for p in BUNDLED}


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_bundled_scenario_loads(path: Path) -> None:
    sc = load(path)
    assert sc.name == path.stem and sc.source == str(path)
    assert len(sc.description) > 200 and ("#" in sc.description or "reference" in sc.description)
    models = [resolve(v) for v in sc.vllm]
    assert [m.name for m in models] == sc.vllm  # each listed release is modelled under its own name
    assert "corrected" in sc.expect and set(sc.expect) - {"corrected"} <= set(sc.vllm)
    for exp in sc.expect.values():
        assert isinstance(exp, str) or len(exp) == sc.decode.tp_size * sc.decode.dp_size  # DP-major
    assert sc.prefill.engine_id != sc.decode.engine_id


@pytest.mark.parametrize("path", [p for p in BUNDLED if p.stem != "seed-19338-tp8"], ids=lambda p: p.stem)
def test_bundled_scenario_is_small(path: Path) -> None:
    """Counts in the thousands: each rank registers tens of MB at most, so a run takes about a second."""
    sc = load(path)
    for inst in (sc.prefill, sc.decode):
        g = inst.geometry()
        assert max(inst.blocks()) < 10_000
        assert max(inst.blocks()) * g.block_len * g.num_regions <= 64 << 20


def test_seed_is_the_logged_instance() -> None:
    sc = load(SCENARIOS / "seed-19338-tp8.toml")
    logged = [111680, 111488, 111488, 111488, 111488, 111488, 112448, 111488]
    for inst in (sc.prefill, sc.decode):
        g = inst.geometry()
        assert inst.blocks() == logged and inst.tp_size == 8
        # block_shape [16, 1, 128] in bfloat16: 4096 B per block, K and V of one layer
        assert (g.block_size, g.local_kv_heads, g.head_dim, g.elem_size, g.block_len, g.num_regions) == (
            16, 1, 128, 2, 4096, 2)
        per_rank = [n * g.block_len * g.num_regions for n in inst.blocks()]
        assert 0.9e9 < min(per_rank) and max(per_rank) < 0.93e9  # "~0.9 GB per rank"


def test_expectations_per_rank_where_ranks_differ() -> None:
    seed = load(SCENARIOS / "seed-19338-tp8.toml")
    assert seed.expect["0.9.1"] == ["ok"] + ["assert"] * 7
    assert seed.expect["0.9.2"] == "ok" == seed.expect["corrected"]
    assert load(SCENARIOS / "decode-fewer-blocks.toml").expect["0.9.1"] == "assert"
    assert load(SCENARIOS / "hetero-p4-d2.toml").expect["0.9.2"] == "error"


# ---- bad input -----------------------------------------------------------------------------------------
BAD: list[tuple[str, str, str]] = [
    ("unknown-key", MINIMAL.replace("num_blocks = 64\n[decode]", "num_blocks = 64\nfoo = 1\n[decode]"),
     "prefill.foo: unknown key"),
    ("unknown-top-key", "bogus = 1\n" + MINIMAL, "bogus: unknown key"),
    ("wrong-type", MINIMAL.replace("[decode]", 'tp_size = "2"\n[decode]'), "prefill.tp_size: expected int, got str"),
    ("wrong-type-list", MINIMAL.replace("num_blocks = 64\n[decode]", 'num_blocks = [1, "x"]\ntp_size = 2\n[decode]'),
     "prefill.num_blocks"),
    ("tp-vs-list", MINIMAL.replace("[decode]\nnum_blocks = 64", "[decode]\ntp_size = 4\nnum_blocks = [1, 2, 3]"),
     "decode.num_blocks: expected 4 entries (one per TP rank, tp_size = 4), got 3"),
    ("negative-count", MINIMAL.replace("[decode]\nnum_blocks = 64", "[decode]\ntp_size = 2\nnum_blocks = [5, -5]"),
     "decode.num_blocks[1]: expected int >= 1"),
    ("zero-count", MINIMAL.replace("num_blocks = 64\n[decode]", "num_blocks = 0\n[decode]"),
     "prefill.num_blocks: expected int >= 1"),
    ("bad-status", MINIMAL + '[expect]\n"0.9.1" = "boom"\n', "expect"),
    ("expect-length", MINIMAL + '[expect]\n"0.9.1" = ["ok", "ok"]\n',
     "expect.0.9.1: expected 1 entries (one per decode rank), got 2"),
    ("bad-dtype", MINIMAL.replace("[decode]", 'dtype = "int4"\n[decode]'), "prefill.dtype: expected one of"),
    ("bad-layout", MINIMAL.replace("[decode]", 'kv_cache_layout = "XYZ"\n[decode]'),
     "prefill.kv_cache_layout: expected one of"),
    ("missing-counts", "[prefill]\ntp_size = 1\n[decode]\nnum_blocks = 64\n", "prefill.num_blocks: required"),
]


@pytest.mark.parametrize(("stem", "text", "needle"), BAD, ids=[b[0] for b in BAD])
def test_bad_scenario_names_file_and_key(tmp_path: Path, stem: str, text: str, needle: str) -> None:
    path = tmp_path / f"{stem}.toml"
    path.write_text(text)
    with pytest.raises(BadInput) as err:
        load(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ")
    assert needle in msg
    assert err.value.exit_code == EXIT_BAD_INPUT


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(BadInput, match="no such scenario file") as err:
        load(path)
    assert str(err.value).startswith(str(path))


def test_bad_toml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[prefill\nnum_blocks = 10\n")
    with pytest.raises(BadInput) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: not valid TOML: ")
    assert "line 1" in str(err.value)


def test_flags_are_checked_like_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text(MINIMAL)
    overrides: dict[str, Any] = {"prefill": {"tp_size": 2, "num_blocks": [10, 20, 30]}}
    with pytest.raises(BadInput) as err:
        load(path, overrides)
    assert str(err.value) == (f"{path} (with flags): prefill.num_blocks: expected 2 entries "
                              "(one per TP rank, tp_size = 2), got 3")
    sc = load(path, {"prefill": {"tp_size": 2, "num_blocks": [10, 20]}})
    assert sc.prefill.blocks() == [10, 20] and sc.decode.blocks() == [64]
