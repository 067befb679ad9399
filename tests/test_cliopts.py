"""pdcheck.cliopts: one definition of the scenario flags, as typer sees them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from pdcheck.cliopts import (
    FLAG_NAMES,
    FLAGS,
    PANEL_SCENARIO,
    PANEL_SIDES,
    overrides_from_flags,
    scenario_flags,
)
from pdcheck.errors import BadInput
from pdcheck.vllm.scenario import load

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "scenarios" / "seed-19338-tp8.toml"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _app() -> typer.Typer:
    """A command built like pdcheck's: flags from the decorator, the scenario from pdcheck.vllm.scenario.load."""
    app = typer.Typer(add_completion=False)

    @app.command()
    @scenario_flags
    def show(scenario: Annotated[Path | None, typer.Argument()] = None, *, overrides: dict[str, Any],
             tag: Annotated[str, typer.Option(help="Something of the command's own.")] = "x") -> None:
        given = json.loads(json.dumps(overrides))  # before load: it fills in defaults in place
        sc = load(scenario, overrides)
        print(json.dumps({"tag": tag, "overrides": given, "p_tp": sc.prefill.tp_size,
                          "p_blocks": sc.prefill.blocks(), "d_blocks": sc.decode.blocks(),
                          "p_dtype": sc.prefill.dtype, "d_dtype": sc.decode.dtype,
                          "p_mla": sc.prefill.use_mla, "p_port": sc.prefill.base_port}))

    @app.command()
    def other() -> None:  # a second command keeps `show` a subcommand, as in pdcheck
        pass

    return app


def _invoke(*args: str) -> Any:
    res = CliRunner().invoke(_app(), ["show", *args], env={"COLUMNS": "200"})
    return res


def test_flags_reach_the_scenario() -> None:
    res = _invoke("--prefill-tp", "2", "--prefill-blocks", "10,20", "--decode-blocks", "30",
                  "--dtype", "float16", "--decode-dtype", "float32", "--use-mla", "--prefill-base-port", "7000",
                  "--tag", "y")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["tag"] == "y"
    assert doc["p_tp"] == 2 and doc["p_blocks"] == [10, 20] and doc["d_blocks"] == [30]
    assert doc["p_dtype"] == "float16" and doc["d_dtype"] == "float32"  # the per-side flag wins
    assert doc["p_mla"] is True and doc["p_port"] == 7000
    assert doc["overrides"] == {
        "prefill": {"tp_size": 2, "num_blocks": [10, 20], "dtype": "float16", "use_mla": True, "base_port": 7000},
        "decode": {"num_blocks": 30, "dtype": "float32", "use_mla": True},
    }


def test_flags_override_a_scenario_file() -> None:
    res = _invoke(str(SEED), "--decode-blocks", "5")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["d_blocks"] == [5] * 8 and doc["p_blocks"][0] == 111680 and doc["p_tp"] == 8


def test_no_flags_no_overrides() -> None:
    res = _invoke(str(SEED))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["overrides"] == {}


def test_help_lists_every_flag_with_help_and_metavar_in_its_panel() -> None:
    res = _invoke("--help")
    assert res.exit_code == 0
    text = ANSI.sub("", res.stdout)
    assert f"─ {PANEL_SCENARIO} " in text and f"─ {PANEL_SIDES} " in text
    for flag in FLAGS:
        opt = "--" + flag.name.replace("_", "-")
        line = next((ln for ln in text.splitlines() if re.search(rf"{re.escape(opt)}(\s|$)", ln)), None)
        assert line is not None, opt
        assert flag.help.split(",")[0] in line, (opt, line)
        if flag.metavar:
            assert f" {flag.metavar} " in line, (opt, line)
    assert "--overrides" not in text  # not a flag
    assert text.index(f"─ {PANEL_SCENARIO} ") < text.index("--prefill-tp") < text.index(f"─ {PANEL_SIDES} ")
    assert text.index(f"─ {PANEL_SIDES} ") < text.index("--prefill-engine-id")


def test_bad_counts_are_bad_input() -> None:
    with pytest.raises(BadInput, match="--prefill-blocks: '1x' is not an integer"):
        overrides_from_flags({"prefill_blocks": "1x"})


def test_the_flag_set() -> None:
    shared = {"block_size", "layers", "kv_heads", "head_dim", "dtype", "kv_cache_layout", "attn_backend"}
    expected = {"prefill_tp", "decode_tp", "prefill_blocks", "decode_blocks", "use_mla", "host",
                "prefill_engine_id", "decode_engine_id", "prefill_base_port", *shared,
                *(f"{s}_{k}" for s in ("prefill", "decode") for k in shared)}
    assert FLAG_NAMES == expected
    assert all(f.help and f.panel in (PANEL_SCENARIO, PANEL_SIDES) for f in FLAGS)


def test_decorator_refuses_a_command_without_overrides_or_with_a_clash() -> None:
    with pytest.raises(TypeError, match="needs an `overrides` parameter"):
        scenario_flags(lambda scenario=None: None)
    with pytest.raises(TypeError, match="clash"):
        scenario_flags(lambda overrides, dtype=None: None)


def test_pdcheck_handshake_help_lists_the_flags() -> None:
    from pdcheck.cli import app

    res = CliRunner().invoke(app, ["handshake", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    text = ANSI.sub("", res.stdout)
    for name in FLAG_NAMES:
        assert "--" + name.replace("_", "-") in text
