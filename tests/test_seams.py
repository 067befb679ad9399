"""Seams: the parts of one report (verdict table, hazard lines, --json) and two commands (probe, handshake
against a live P) must tell one story.

(a) For a grid of shapes (P TP = heads, P TP > heads, P TP < heads, MLA, P < D, P > D) the corrected model's
reads (the engine: which P ranks each D rank handshakes, refused or not) agree with every hazard line's
"corrected" text, and both with what is right: each D rank reads, for each KV head it holds, exactly one P rank
holding that head (vLLM 0.34's TransferTopology: P's KV is replicated only when P TP > the KV heads). The grid
runs the pure engine and the hazard catalogue in-process; a handful of shapes go through the real CLI (real ranks,
real NIXL transfers), where the rich table and the JSON must agree as well.
(b) For every wire era, `probe` and `handshake --prefill-endpoint` against the same `pdcheck serve` give the same
verdict and exit code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from releasekit import Side, run_all, side
from test_live import ERAS, ROOT, SCEN, pdcheck, probe_json, serve

from pdcheck.vllm.engine import Outcome
from pdcheck.vllm.hazards import Hazard, evaluate
from pdcheck.vllm.releases import CORRECTED, resolve
from pdcheck.vllm.scenario import Scenario, load

RELEASES = ["0.9.1", "0.11.1", "0.14.0", "0.20.0", "0.34.0"]

# (P TP, D TP, KV heads, MLA)
SHAPES = [
    *[(t, t, t, False) for t in (1, 2, 4, 8)],  # P TP = D TP = heads
    (8, 2, 8, False),  # P TP = heads > D TP: every P rank holds its own head (the report)
    (4, 2, 4, False), (4, 1, 4, False), (2, 1, 2, False),
    (8, 2, 4, False), (8, 4, 4, False), (8, 2, 2, False), (16, 4, 8, False), (8, 4, 2, False),  # P TP > heads
    (4, 2, 8, False), (8, 2, 16, False), (2, 1, 8, False),  # P TP < heads, P > D
    (2, 4, 8, False), (2, 8, 8, False), (1, 4, 8, False), (4, 8, 8, False),  # P < D
    (2, 8, 4, False), (4, 16, 8, False), (4, 8, 4, False), (2, 4, 2, False),  # P < D with D TP > heads
    (8, 8, 4, False), (4, 4, 2, False),  # P TP = D TP > heads
    (8, 2, 1, True), (4, 2, 1, True), (2, 8, 1, True), (4, 4, 1, True), (8, 2, 8, True),  # MLA
    (3, 2, 6, False), (2, 3, 6, False), (6, 4, 12, False),  # TP sizes that do not divide
]


def _sides(p_tp: int, d_tp: int, heads: int, mla: bool) -> tuple[Side, Side]:
    kw: dict[str, Any] = dict(kv_heads=heads, head_dim=64, mla=mla, backend="FLASH_ATTN_MLA" if mla else "FLASH_ATTN")
    p = side("P", p_tp, [1000 + 8 * (r % 3) for r in range(p_tp)], **kw)  # uneven: the counts show who was read
    d = side("D", d_tp, 1000, **kw)
    return p, d


def _scenario(p: Side, d: Side) -> Scenario:
    def inst(s: Side) -> dict[str, Any]:
        return {"engine_id": s.engine_id, "tp_size": s.tp, "num_blocks": s.blocks, "kv_heads": s.kv_heads,
                "head_dim": s.head_dim, "use_mla": s.mla, "attn_backend": s.backend, "kv_cache_layout": s.layout,
                "block_size": s.block_size, "layers": s.layers, "dtype": s.dtype}

    return load(None, {"vllm": RELEASES, "prefill": inst(p), "decode": inst(d)})


def _corrected(p: Side, d: Side) -> list[Outcome]:
    """The corrected model on every D rank, meeting a P of the last release's era, as in `handshake`."""
    return run_all(CORRECTED, p, d, p_wire=resolve(RELEASES[-1]).wire)


# ---- what is right, worked out from the heads (not from pdcheck's rule) -----------------------------------
def _heads(rank: int, tp: int, heads: int, mla: bool) -> set[int]:
    if mla:
        return {0}  # the latent: whole on every rank
    if tp <= heads:
        return set(range(rank * heads // tp, (rank + 1) * heads // tp))
    return {rank * heads // tp}  # more ranks than heads: consecutive ranks share a head


def assert_reads_are_right(reads: list[int], r: int, p_tp: int, d_tp: int, heads: int, mla: bool) -> None:
    """Each of D rank r's heads from exactly one P rank read, and every P rank read gives it at least one."""
    want = _heads(r, d_tp, heads, mla)
    got: list[int] = []
    for p in reads:
        share = _heads(p, p_tp, heads, mla) & want
        assert share, f"D rank {r} reads P rank {p}, which holds none of its heads {sorted(want)}"
        got += sorted(share)
    assert sorted(got) == sorted(want), f"D rank {r} reads P ranks {reads}: heads {got}, wants {sorted(want)}"


# ---- what the hazard lines say the corrected model does ---------------------------------------------------
def _ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def assert_lines_agree(hazards: list[Hazard], outs: list[Outcome], p_tp: int, d_tp: int, heads: int,
                       mla: bool) -> None:
    """Every applicable hazard's corrected line against the corrected engine's outcome on every D rank."""
    lines = {h.id: h.effects[CORRECTED.name] for h in hazards if h.applies and CORRECTED.name in h.effects}
    refused = {o.check for o in outs if o.status != "ok"}
    divides = max(p_tp, d_tp) % min(p_tp, d_tp) == 0
    # The TP pair: refused only where the sizes do not divide, and then the lines say so.
    assert (refused == {"tp_divisible"}) == (not divides), (refused, lines)
    if not divides:
        assert lines["H11"].startswith(f"refused: TP sizes D={d_tp} and P={p_tp} do not divide"), lines
        return
    assert not refused, f"the corrected model refuses a shape it supports: {[o.message for o in outs]}"
    for hid, line in lines.items():
        assert "refused: P block is" not in line, f"{hid} says the corrected model refuses: {line}"
        assert "do not divide" not in line, f"{hid}: {line}"
        if m := re.search(r"each D rank reads (one|\d+) P ranks?", line):
            n = 1 if m.group(1) == "one" else int(m.group(1))
            assert all(len(o.contacted) == n for o in outs), (hid, line, [o.contacted for o in outs])
        if m := re.search(r"D rank 0 reads P ranks? ([\d,-]+)", line):
            assert _ranks(m.group(1)) == outs[0].contacted, (hid, line, outs[0].contacted)
        if "replicated KV" in line:
            assert not mla and p_tp > heads, f"{hid} calls P TP {p_tp} with {heads} KV heads replicated: {line}"
    if p_tp > d_tp:  # a P > D pair always says how it is read
        assert re.search(r"each D rank reads (one|\d+) P rank", lines["H11"]), lines["H11"]
    if "H08" in lines:
        assert lines["H08"].startswith("accepts"), lines["H08"]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "mla"), SHAPES,
                         ids=[f"p{p}-d{d}-h{h}{'-mla' if m else ''}" for p, d, h, m in SHAPES])
def test_corrected_story_is_one_story(p_tp: int, d_tp: int, heads: int, mla: bool) -> None:
    p, d = _sides(p_tp, d_tp, heads, mla)
    outs = _corrected(p, d)
    hazards = evaluate(_scenario(p, d), [resolve(v) for v in RELEASES])
    assert_lines_agree(hazards, outs, p_tp, d_tp, heads, mla)
    if max(p_tp, d_tp) % min(p_tp, d_tp) == 0:
        for r, o in enumerate(outs):
            assert o.status == "ok", o.message
            assert_reads_are_right(o.contacted, r, p_tp, d_tp, heads, mla)
            # each P rank's list keeps that rank's own count (corrected: no aliasing)
            assert o.rank_num_blocks == {q: p.blocks[q] for q in o.contacted}


def test_the_reported_shape() -> None:
    """Issue 14's command: P TP 8 = 8 KV heads, D TP 2, P ranks 1 and 3 uneven, vLLM 0.34.0. One head per P rank
    (not replicated): corrected reads P ranks 0-3 and 4-7 and accepts 4096 B blocks; 0.34 handshakes the same
    ranks and stops at the num_blocks equality on D rank 0 (H03), which the hazard table must name."""
    kw: dict[str, Any] = dict(kv_heads=8, head_dim=128)
    p = side("P", 8, [1000, 1016, 1000, 992, 1000, 1000, 1000, 1000], **kw)
    d = side("D", 2, 1000, **kw)
    rel = resolve("0.34.0")
    hz = {h.id: h for h in evaluate(_scenario(p, d), [rel]) if h.applies}
    outs = _corrected(p, d)
    assert [o.contacted for o in outs] == [[0, 1, 2, 3], [4, 5, 6, 7]] and {o.status for o in outs} == {"ok"}
    assert {"H08", "H13"}.isdisjoint(hz), {k: h.effects for k, h in hz.items()}
    assert hz["H11"].effects["corrected"].endswith("D rank 0 reads P ranks 0-3")
    r34 = run_all(rel, p, d)
    assert [(o.status, o.check, o.handshake) for o in r34] == [("assert", "dst_num_blocks_equal", 2), ("ok", None, None)]
    assert "fires on D rank 0" in hz["H03"].effects["0.34.0"]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "mla"), SHAPES,
                         ids=[f"p{p}-d{d}-h{h}{'-mla' if m else ''}" for p, d, h, m in SHAPES])
def test_each_release_block_len_line_matches_its_verdict(p_tp: int, d_tp: int, heads: int, mla: bool) -> None:
    """Per release: H08 has a line for it exactly where its handshake stops at a block-length check (even
    counts, so no num_blocks assert stops a rank first)."""
    p, d = _sides(p_tp, d_tp, heads, mla)
    p = side("P", p_tp, 1000, kv_heads=heads, head_dim=64, mla=mla, backend=p.backend)
    rels = [resolve(v) for v in RELEASES]
    h08 = next(h for h in evaluate(_scenario(p, d), rels) if h.id == "H08")
    for rel in rels:
        stops = {o.hazard for o in run_all(rel, p, d) if o.status != "ok"}
        said = h08.effects.get(rel.name, "") if h08.applies else ""
        assert ("H08" in stops) == ("fails" in said), (rel.name, stops, said)


MISMATCHES = [{"block_size": 32}, {"kv_heads": 16}, {"head_dim": 128}, {"dtype": "float32"},
              {"block_size": 32, "kv_heads": 4}]  # the last: the same block length, another block size


@pytest.mark.parametrize("tps", [(2, 2), (2, 4), (4, 2), (8, 2)], ids=lambda t: f"p{t[0]}-d{t[1]}")
@pytest.mark.parametrize("diff", MISMATCHES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_corrected_refusal_is_named_once(diff: dict[str, Any], tps: tuple[int, int]) -> None:
    """A real mismatch: every hazard line that says the corrected model refuses gives the reason (and bytes) the
    corrected engine gives, and the engine's refusal is named by some line."""
    p_tp, d_tp = tps
    base: dict[str, Any] = dict(kv_heads=8, head_dim=64)
    p, d = side("P", p_tp, 1000, **{**base, **diff}), side("D", d_tp, 1000, **base)
    outs = _corrected(p, d)
    hazards = evaluate(_scenario(p, d), [resolve(v) for v in RELEASES])
    lines = [h.effects[CORRECTED.name] for h in hazards if h.applies and CORRECTED.name in h.effects]
    msgs = {o.message for o in outs if o.status != "ok"}
    assert len(msgs) <= 1, msgs
    engine = msgs.pop() if msgs else None
    for line in lines:
        if m := re.search(r"P block is \d+ B, D expects \d+ B", line):
            assert engine is not None and m.group(0) in engine, (line, engine)
        if "refused: P block_size" in line:
            assert engine is not None and engine.startswith("refused: P block_size"), (line, engine)
    if engine is not None:
        assert any(engine.split(" (")[0] in line for line in lines), (engine, lines)


@pytest.mark.parametrize("told", [1, 2, 4, None], ids=lambda t: f"tp_size{t}")
@pytest.mark.parametrize("tps", [(2, 4), (4, 4), (4, 2), (2, 2)], ids=lambda t: f"p{t[0]}-d{t[1]}")
def test_corrected_lines_when_kv_transfer_params_tp_size_is_wrong(tps: tuple[int, int], told: int | None) -> None:
    """kv_transfer_params with a wrong (or no) tp_size: no line calls the pair supported while the corrected
    engine, which trusts them, refuses; a refusal is named with the engine's bytes."""
    p_tp, d_tp = tps
    p, d = side("P", p_tp, 1000, kv_heads=8, head_dim=64), side("D", d_tp, 1000, kv_heads=8, head_dim=64)
    sc = load(None, {"vllm": RELEASES, "prefill": {"engine_id": "P", "tp_size": p_tp, "num_blocks": 1000,
                                                   "head_dim": 64},
                     "decode": {"engine_id": "D", "tp_size": d_tp, "num_blocks": 1000, "head_dim": 64},
                     "kv_transfer_params": {"omit_tp_size": True} if told is None else {"tp_size": told}})
    outs = run_all(CORRECTED, p, d, tp=sc.params_tp_size(), p_wire=resolve(RELEASES[-1]).wire)
    lines = [h.effects["corrected"] for h in evaluate(sc, [resolve(v) for v in RELEASES])
             if h.applies and "corrected" in h.effects]
    refusals = {o.message for o in outs if o.status != "ok"}
    for line in lines:
        assert not (line.startswith("supported") and refusals), (line, refusals)
        if m := re.search(r"P block is \d+ B, D expects \d+ B", line):
            assert any(m.group(0) in r for r in refusals), (line, refusals)


# ---- the real CLI: table, hazard lines and JSON of one run -------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="400")  # wide: no cell or hazard line is wrapped
    return subprocess.run([sys.executable, "-m", "pdcheck", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def _table_reads(text: str) -> list[list[int]]:
    """The corrected column's 'P0,1,2,3 n=...' line of each decode rank, in table order."""
    reads = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and " n=" in cells[-2]:
            m = re.match(r"P([\d,]+) n=", cells[-2])
            assert m, cells[-2]
            reads.append([int(x) for x in m.group(1).split(",")])
    return reads


CLI_SHAPES = [(8, 2, 8, False), (8, 2, 4, False), (4, 2, 8, False), (2, 4, 8, False), (4, 2, 1, True)]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "mla"), CLI_SHAPES,
                         ids=[f"p{p}-d{d}-h{h}{'-mla' if m else ''}" for p, d, h, m in CLI_SHAPES])
def test_cli_table_hazards_and_json_agree(p_tp: int, d_tp: int, heads: int, mla: bool) -> None:
    p, d = _sides(p_tp, d_tp, heads, mla)
    args = ["handshake", "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
            "--prefill-blocks", ",".join(map(str, p.blocks)), "--decode-blocks", ",".join(map(str, d.blocks)),
            "--kv-heads", str(heads), "--head-dim", "64", "--layers", "1", "--vllm", "0.34.0"]
    if mla:
        args += ["--use-mla", "--attn-backend", "FLASH_ATTN_MLA"]
    rich, js = _cli(*args), _cli(*args, "--json")
    assert "Traceback" not in rich.stderr + js.stderr, rich.stderr + js.stderr
    assert rich.returncode == js.returncode
    doc = json.loads(js.stdout)
    verdicts = [dr["verdicts"]["corrected"] for dr in doc["decode_ranks"]]
    outs = [Outcome(status=v["status"], check=v["check"], message=v["message"], contacted=v["contacted"])
            for v in verdicts]
    # the table shows the JSON's reads, the hazard lines (rich and JSON) say the same, and both are right
    assert _table_reads(rich.stdout) == [v["contacted"] for v in verdicts]
    shown = re.findall(r"│\s+corrected: (.*?)\s*│", rich.stdout)
    hazards = [Hazard(**h) for h in doc["hazards"]]
    assert shown == [h.effects["corrected"] for h in hazards if h.applies and "corrected" in h.effects]
    assert_lines_agree(hazards, outs, p_tp, d_tp, heads, mla)
    for r, v in enumerate(verdicts):
        assert v["status"] == "ok", v
        assert_reads_are_right(v["contacted"], r, p_tp, d_tp, heads, mla)
        t = dict(doc["decode_ranks"][r]["transfer"]["corrected"])
        assert t["status"] == "ok" and t["blocks"] > 0 and t["wrong"] == 0, t  # the bytes read are the right ones


# ---- probe and handshake --prefill-endpoint against one serve, every era -------------------------------------
# seed-19338-tp8 in every era (uneven counts, same TP: only 0.9.1 fails); hetero-d4-p2 (D TP 4 from P TP 2) in a
# per-worker, a scheduler and a two-frame era
LIVE_CASES = [*((era, "seed-19338-tp8") for era in ERAS), ("B", "hetero-d4-p2"), ("F", "hetero-d4-p2"),
              ("H", "hetero-d4-p2")]


@pytest.mark.parametrize(("era", "name"), LIVE_CASES, ids=[f"{e}-{n}" for e, n in LIVE_CASES])
def test_probe_and_live_handshake_give_one_verdict(era: str, name: str) -> None:
    release = ERAS[era]
    sc = SCEN / f"{name}.toml"
    p_tp = load(sc).prefill.tp_size
    with serve(str(sc), "--vllm", release) as s:
        code, rep = probe_json(s.endpoint, "--vllm", release, "--tp-size", str(p_tp), "--scenario", str(sc))
        hs = pdcheck("handshake", str(sc), "--vllm", release, "--prefill-endpoint", s.endpoint, "--json")
    assert "Traceback" not in hs.stderr, hs.stderr
    doc = json.loads(hs.stdout)
    assert code == hs.returncode, (rep["verdict"], rep.get("decode_status"), doc["matrix"])
    assert (rep["verdict"] == "ok") == doc["survives"][release]
    assert rep["decode_status"] == doc["matrix"][release]  # D rank by D rank
    if name == "seed-19338-tp8":
        # the reported case: uneven counts on P ranks 0 and 6 break 0.9.1 only (its rank-0 pre-handshake)
        assert code == (1 if release == "0.9.1" else 0)


@pytest.mark.parametrize("release", ["0.11.1", "0.26.0", "0.34.0"])
def test_refusal_names_the_same_bytes_in_table_and_hazard_line(release: str) -> None:
    """A real mismatch (P 8 KV heads, D 4): the corrected verdict and H08's corrected line quote the same block
    lengths, measured on the KV layout the release's ranks register (packed K|V from 0.26)."""
    r = _cli("handshake", str(SCEN / "kv-heads-mismatch.toml"), "--vllm", release, "--no-transfer", "--json")
    doc = json.loads(r.stdout)
    refusals = {dr["verdicts"]["corrected"]["message"] for dr in doc["decode_ranks"]}
    h08 = next(h for h in doc["hazards"] if h["id"] == "H08")
    assert h08["applies"] and len(refusals) == 1
    assert refusals.pop().startswith(h08["effects"]["corrected"] + " ("), h08["effects"]["corrected"]


# ---- the framework seam: frameworks are entry points; nothing outside them names one; a third framework is one
# package and one entry point (tests/toyfw), pdcheck not edited for it ----------------------------------------------
PKG = ROOT / "pdcheck"


def _registry() -> dict[str, str]:
    """Every registered framework's name -> the package its entry point lives in (pdcheck.vllm, pdcheck.sglang,
    pdcheck_toy where it is installed): what the checks below forbid elsewhere, from the registry itself."""
    from pdcheck import frameworks

    out = {}
    for name, ep in frameworks._entry_points().items():
        module = ep.value.split(":")[0]
        out[name] = module.rsplit(".", 1)[0] if module.startswith("pdcheck.") else module.split(".")[0]
    return out


def _literals(node: Any) -> set[str]:
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _literals(e)}
    return set()


def _imports(tree: Any) -> list[tuple[int, str]]:
    """Every module a tree imports, at any depth (module-level and inside functions), as absolute names."""
    import ast

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out += [(node.lineno, node.module or ""), *((node.lineno, f"{node.module}.{a.name}") for a in node.names)]
    return out


def framework_forks(source: str, registry: dict[str, str]) -> list[str]:
    """Where a module branches on a framework: `x == "sglang"`, `x in ("vllm", "sglang")`, `if sglang ...`,
    or an import of a framework's package."""
    import ast

    names, packages = set(registry), set(registry.values())
    tree = ast.parse(source)
    found = [f"line {line}: imports {mod}" for line, mod in _imports(tree)
             if any(mod == p or mod.startswith(p + ".") for p in packages)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                named = (_literals(right) | _literals(node.left)) if isinstance(op, (ast.Eq, ast.NotEq)) else (
                    _literals(right) if isinstance(op, (ast.In, ast.NotIn)) else set())
                if named & names:
                    found.append(f"line {node.lineno}: compares with {sorted(named & names)}")
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)):
            hit = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)} & names
            if hit:
                found.append(f"line {node.lineno}: branches on `{sorted(hit)[0]}`")
    return found


def _outside_the_frameworks() -> list[Any]:
    """pdcheck's modules that belong to no framework's package."""
    own = tuple(p.removeprefix("pdcheck.").replace(".", "/") + "/" for p in _registry().values()
                if p.startswith("pdcheck."))
    return [p for p in sorted(PKG.rglob("*.py")) if not p.relative_to(PKG).as_posix().startswith(own)]


def test_the_registry_lists_the_built_in_frameworks_as_entry_points() -> None:
    reg = _registry()
    assert {"vllm": "pdcheck.vllm", "sglang": "pdcheck.sglang"}.items() <= reg.items(), reg


def test_no_framework_fork_outside_the_frameworks_packages() -> None:
    """Commands, the registry, the runtime, smoke, render, doctor, bench: none names a framework or imports one's
    package (the names and packages come from the registry, so a new framework is covered as it registers)."""
    reg = _registry()
    forks = {p.relative_to(PKG).as_posix(): found for p in _outside_the_frameworks()
             if (found := framework_forks(p.read_text(), reg))}
    assert not forks, f"framework forks outside the frameworks' packages (ask the registry instead): {forks}"


def test_the_fork_finder_finds_forks() -> None:
    reg = {"vllm": "pdcheck.vllm", "sglang": "pdcheck.sglang", "trtllm": "pdcheck.trtllm"}
    for fork in ('if framework == "sglang":\n    pass', 'x = a if fw in ("vllm", "sglang") else b',
                 "if sglang is not None:\n    pass", "from pdcheck.sglang import plan",
                 "import pdcheck.vllm.framework", "def f():\n    from pdcheck.vllm.requests.faults import NAMES",
                 'if kind == "trtllm":\n    pass', "from pdcheck.trtllm import wire"):
        assert framework_forks(fork, reg), fork
    assert not framework_forks('ok = "vllm" in doc\nname = "sglang"\nfrom pdcheck import frameworks', reg)


# The layers (docs/architecture.md): only the command layer asks the registry; a framework's package and everything
# below (runtime, rules, render, bench, doctor's checks) know the seam's types (pdcheck.seam) at most.
COMMAND_LAYER = ("__main__.py", "cli.py", "cliopts.py", "commands/", "catalog.py", "smoke.py", "frameworks.py")


def test_only_the_command_layer_imports_the_registry() -> None:
    import ast

    found = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith(COMMAND_LAYER):
            continue
        hits = [f"line {line}" for line, mod in _imports(ast.parse(p.read_text()))
                if mod in ("pdcheck.frameworks",) or mod.startswith("pdcheck.frameworks.")]
        if hits:
            found[rel] = hits
    assert not found, f"the registry imported below the command layer (an arrow pointing up): {found}"


# ---- the toy framework: a package of its own, installed with pip, registered only by its entry point -----------
TOY = ROOT / "tests" / "data" / "toy" / "toy-header.toml"


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the toy framework is importable: already installed (.ci/run installs it), else pip-installed here
    into a directory of its own (the real package build and its entry point; nothing of pdcheck edited)."""
    from importlib.metadata import entry_points

    if any(ep.name == "toy" for ep in entry_points(group="pdcheck.frameworks")):
        return ""
    import shutil

    target, src = tmp_path_factory.mktemp("toy"), tmp_path_factory.mktemp("toysrc") / "toyfw"
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources, which two workers (xdist)
    # installing at once would share
    shutil.copytree(ROOT / "tests" / "toyfw", src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return str(target)


def _toy_names(toy_path: str) -> list[str]:
    """The registry's names where the toy is installed, as the toy's pdcheck process sees them."""
    code = "from pdcheck import frameworks; print(','.join(frameworks.names()))"
    path = os.pathsep.join(p for p in (toy_path, str(ROOT)) if p)
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                         text=True, timeout=60, check=True)
    names = run.stdout.strip().split(",")
    assert "toy" in names, names
    return names


def _toy(toy_path: str, *args: str, cwd: Any = ROOT) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (toy_path, str(ROOT)) if p)
    env = dict(os.environ, PYTHONPATH=path, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "pdcheck", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.xdist_group("toy")
def test_the_toy_framework_runs_through_every_command_it_declares(toy_path: str, tmp_path: Any) -> None:
    """handshake (table, --json, --format markdown), smoke, list: real ranks on the skeleton, real NIXL READs of a
    P that only waits for Stop (the skeleton drives its NIXL worker: without it the READ times out)."""
    table, js = _toy(toy_path, "handshake", str(TOY)), _toy(toy_path, "handshake", str(TOY), "--json")
    assert table.returncode == js.returncode == 1, table.stderr + js.stderr  # release 2.0 asserts
    assert "'1.0': ['ok'], '2.0': ['assert']" in table.stdout
    doc = json.loads(js.stdout)
    assert doc["framework"] == "toy" and doc["command"] == "handshake" and doc["exit_code"] == 1
    assert doc["matrix"] == {"1.0": ["ok"], "2.0": ["assert"]}
    one = _toy(toy_path, "handshake", str(TOY), "--toy", "1.0", "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["matrix"] == {"1.0": ["ok"]}
    page = _toy(toy_path, "handshake", str(TOY), "--format", "markdown")
    assert page.returncode == 1 and "toy-header" in page.stdout, page.stderr
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / TOY.name).write_text(TOY.read_text())
    smoke = _toy(toy_path, "smoke", str(tmp_path), "--json")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    cases = json.loads(smoke.stdout)["cases"]
    assert [(c["framework"], c["release"], c["passed"], c["got"]) for c in cases] == [
        ("toy", "1.0", True, ["ok"]), ("toy", "2.0", True, ["assert"])]
    listed = " ".join(_toy(toy_path, "smoke", "--help").stdout.split())
    assert f"({', '.join(_toy_names(toy_path))};" in listed, listed  # smoke's --framework help: the registry's


@pytest.mark.xdist_group("toy")
@pytest.mark.parametrize(("args", "says"), [
    (["handshake", str(TOY), "--device", "cuda"], "--device: not available for Toy in `pdcheck handshake`"),
    (["handshake", str(TOY), "--no-transfer"], "--no-transfer: not available for Toy in `pdcheck handshake`"),
    (["handshake", str(TOY), "--prefill-tp", "2"], "--prefill-tp: not available for Toy in `pdcheck handshake`"),
    (["handshake", str(TOY), "--vllm", "0.9.1"], "is a Toy scenario; use --toy"),
    (["handshake", "seed-19338-tp8", "--toy", "1.0"], "seed-19338-tp8.toml is a vLLM scenario; use --vllm"),
    (["probe", "127.0.0.1:9", "--toy", "1.0"], "No such option: --toy"),
])
def test_an_undeclared_flag_or_another_frameworks_scenario_is_one_line(toy_path: str, args: list[str],
                                                                       says: str) -> None:
    run = _toy(toy_path, *args)
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


# The runtime every framework shares (docs/architecture.md): none of it imports a framework's package, the
# registry, or the seam's adapters, so a new framework plugs in without touching it.
RUNTIME = ("launcher", "orchestrate", "messages", "sidechannel", "ranks", "nixlagent", "kvcache", "lifecycle",
           "placement", "netio", "envelope", "verdict", "releaseline", "errors", "geometry", "kvsplit",
           "scenariofile", "seam", "bounds", "pattern")


@pytest.mark.parametrize("module", RUNTIME)
def test_the_runtime_imports_no_framework(module: str) -> None:
    import ast

    packages = set(_registry().values()) | {"pdcheck.frameworks"}
    found = [f"line {line}: {mod}" for line, mod in _imports(ast.parse((PKG / f"{module}.py").read_text()))
             if any(mod == p or mod.startswith(p + ".") for p in packages)]
    assert not found, f"pdcheck/{module}.py imports a framework's package or the registry: {found}"


def test_the_architecture_page_names_only_files_that_exist() -> None:
    """docs/architecture.md's change areas and tables name the files a change touches: each must exist."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:pdcheck|tests|scenarios|docs)/[A-Za-z0-9_./-]+\.(?:py|md|toml))`", text))
    named |= {f"pdcheck/{m}" for m in re.findall(r"\| `((?:vllm/|bench/|render/)?[a-z_]+\.py)`", text)}
    templates = {n for n in named if any(t in n for t in ("<", "X_Y", "vX"))}
    assert len(named - templates) > 20, named
    missing = sorted(n for n in named - templates if not (ROOT / n).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
