"""A request-path run's typed plan: a scenarios/requests/requests-*.toml file and/or flags, checked before anything starts
(bad input: one line naming what and where, exit 2).

File format (every key optional; flags win):

    [requests]
    issue = "vLLM PR #50754"          # what the scenario reproduces (shown, not checked)
    requests = 8                      # how many
    rate = 10.0                       # arrivals per second
    lease = 0.5                       # seconds: the abort timeout / lease of every release that has one
    blocks_per_request = 2
    pool = 8                          # P's KV blocks
    seed = 0                          # which requests a fault's p=SHARE picks
    failure_policy = "recompute"      # kv_load_failure_policy of 0.13+ (default: each release's own)
    mode = "push"                     # pull (default) | push: NixlPushConnector, 0.24+ (P TP > D TP: 0.26+)

    [prefill]                         # the shape, as handshake scenarios give it (default 1 each)
    tp_size = 2
    dp_size = 1
    [decode]
    tp_size = 2

    [faults]                          # NAME = true | "ARGS" | ["ARGS", ...]  (as --fault NAME:ARGS)
    slow-decode = "1.5"

    [expect]                          # per release: one verdict for every request, or one per request, or
                                      # (on a shape) one per (request, D TP rank), request by request
    "0.9.1" = "delivered"
    corrected = "recomputed"
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import msgspec

from pdcheck import bounds
from pdcheck.errors import BadInput
from pdcheck.vllm.requests import faults as fl
from pdcheck.vllm.requests.lines import POLICIES, Lifecycle, line_of, with_policy
from pdcheck.vllm.requests.model import VERDICTS
from pdcheck.vllm.requests.push import MODES, PP_SINCE, PUSH_SINCE, has_pp
from pdcheck.vllm.requests.push import available as push_available
from pdcheck.vllm.requests.run import Options
from pdcheck.vllm.requests.shapes import MAX_RANKS, WORLD_SINCE, Shape

MAX_REQUESTS = 5000
MAX_RATE = 10_000.0
MIN_RATE = bounds.MIN_RATE  # 1e-300 would put the second arrival past any timeout
MAX_POOL = 4096
MAX_BLOCKS_PER_REQUEST = 64
MIN_LEASE_S, MAX_LEASE_S = bounds.LEASE_S
TIME_SCALE_ENV = "PDCHECK_TIME_SCALE"  # --time-scale's default: a loaded CI machine sets it once for every run
_KEYS = {"issue", "requests", "rate", "lease", "blocks_per_request", "pool", "seed", "failure_policy", "mode"}


class RequestsPlan(msgspec.Struct, frozen=True):
    source: str  # the scenario file, or "flags"
    name: str
    issue: str
    releases: list[tuple[str, Lifecycle]]
    options: Options
    expect: dict[str, list[str]]  # release -> a verdict per request (from [expect])


def _number(where: str, key: str, value: Any, lo: float, hi: float, integer: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise BadInput(f"{where}: {key} must be {'an integer' if integer else 'a number'}, not {value!r}")
    if not math.isfinite(value) or not lo <= value <= hi or (lo == 0 and value == 0):
        raise BadInput(f"{where}: {key} = {value!r} is out of range ({'>' if lo == 0 else '>='} {lo:g}, <= {hi:g})")
    return value


def _fault_items(where: str, table: Any) -> list[str]:
    if not isinstance(table, dict):
        raise BadInput(f"{where}: [faults] must be a table of NAME = true | \"ARGS\" | [\"ARGS\", ...]")
    out: list[str] = []
    for name, val in table.items():
        vals = val if isinstance(val, list) else [val]
        if not vals:
            raise BadInput(f"{where}: [faults] {name} = []: give true, an argument string or a non-empty list")
        for v in vals:
            if v is True:
                out.append(name)
            elif isinstance(v, str):
                out.append(f"{name}:{v}" if v else name)
            else:
                raise BadInput(f"{where}: [faults] {name} = {v!r}: give true or an argument string")
    return out


def build(scenario: Path | None, doc: dict[str, Any], vllm: str | None, flags: dict[str, Any],
          fault_flags: list[str], shape_flags: dict[str, dict[str, int]] | None = None) -> RequestsPlan:
    """doc: the scenario's TOML ({} without one); flags: the numeric flags given (None: not given); shape_flags:
    --prefill-tp / --decode-dp ... as cliopts.SHAPE_FLAGS give them ({side: {key: value}}), over the file's."""
    from pdcheck.suggest import did_you_mean
    from pdcheck.vllm.releases import CORRECTED, resolve_many

    where = str(scenario) if scenario is not None else "command line"
    tables = ("requests", "prefill", "decode", "faults", "expect")
    unknown = set(doc) - set(tables)
    # A request-path scenario has a [requests] or [faults] table, or [prefill]/[decode] with the shape keys alone (its
    # TP/DP shape, the defaults for the rest); other keys there or at the top are a handshake scenario's.
    shape_only = all(set(doc.get(side) or {}) <= {"tp_size", "dp_size"} for side in ("prefill", "decode")
                     if isinstance(doc.get(side), dict))
    if "requests" not in doc and "faults" not in doc and {"prefill", "decode"} & set(doc) and (
            unknown or not shape_only):
        name = scenario.stem if scenario is not None else "SCENARIO"
        raise BadInput(f"{where}: a handshake scenario (it has [prefill]/[decode] with handshake keys, no "
                       f"[requests]); run it with: pdcheck handshake {name}")
    if unknown:
        hint = "".join(did_you_mean(k, tables) for k in sorted(unknown))
        raise BadInput(f"{where}: unknown table(s) {', '.join(sorted(unknown))} (known: {', '.join(tables)})"
                       f"{hint}")
    shape = _shape(where, doc, shape_flags or {})
    req = doc.get("requests", {})
    if not isinstance(req, dict):
        raise BadInput(f"{where}: [requests] must be a table")
    bad = set(req) - _KEYS
    if bad:
        hint = "".join(did_you_mean(k, _KEYS) for k in sorted(bad))
        raise BadInput(f"{where}: [requests] unknown key(s) {', '.join(sorted(bad))} (known: "
                       f"{', '.join(sorted(_KEYS))}){hint}")
    vals = {k: v for k, v in req.items() if k != "issue"}
    policy = flags.get("failure_policy") if flags.get("failure_policy") is not None else req.get("failure_policy")
    if policy is not None and policy not in POLICIES:
        origin = "--failure-policy" if flags.get("failure_policy") is not None else f"{where}: [requests]"
        raise BadInput(f"{origin}: failure_policy must be fail or recompute, not {policy!r}")
    mode_origin = "--mode" if flags.get("mode") is not None else f"{where}: [requests]"
    mode = flags.get("mode") if flags.get("mode") is not None else req.get("mode", "pull")
    if mode not in MODES:
        raise BadInput(f"{mode_origin}: mode must be pull or push, not {mode!r}")
    vals.pop("mode", None)
    vals.update({k: v for k, v in flags.items() if v is not None and k not in ("mode", "time_scale")})

    def src(key: str) -> str:
        return f"--{key.replace('_', '-')}" if flags.get(key) is not None else f"{where}: [requests]"

    n = int(_number(src("requests"), "requests", vals.get("requests", 8), 1, MAX_REQUESTS, True))
    rate = float(_number(src("rate"), "rate", vals.get("rate", 10.0), MIN_RATE, MAX_RATE, False))
    lease = vals.get("lease")
    if lease is not None:
        lease = float(_number(src("lease"), "lease", lease, MIN_LEASE_S, MAX_LEASE_S, False))
    per = int(_number(src("blocks_per_request"), "blocks_per_request", vals.get("blocks_per_request", 2), 1,
                      MAX_BLOCKS_PER_REQUEST, True))
    pool = int(_number(src("pool"), "pool", vals.get("pool", 8), per, MAX_POOL, True))
    seed = int(_number(src("seed"), "seed", vals.get("seed", 0), -(2**31), 2**31, True))
    # each fault is blamed where it was given: the file's [faults], or the --fault flag
    items = _fault_items(where, doc.get("faults", {}))
    faults = (*fl.parse_all(items, n, f"{where}: faults", seed), *fl.parse_all(fault_flags, n, "--fault", seed))
    origins = [f"{where}: fault" if k < len(items) else "--fault" for k in range(len(faults))]
    if len(faults) > fl.MAX_FAULTS:
        raise BadInput(f"{where}: [faults] and --fault: {len(faults)} faults; at most {fl.MAX_FAULTS}")
    expect_doc = doc.get("expect", {})
    if not isinstance(expect_doc, dict):
        raise BadInput(f"{where}: [expect] must be a table of release = verdict | [verdicts]")
    expect: dict[str, list[str]] = {}
    for rel, want in expect_doc.items():
        wants = want if isinstance(want, list) else [want] * n
        if len(wants) == n and shape.d_tp > 1:  # one per request: every D TP rank of it
            wants = [w for w in wants for _ in range(shape.d_tp)]
        if len(wants) != n * shape.d_tp or any(w not in VERDICTS for w in wants):
            odd = next((w for w in wants if w not in VERDICTS), None)
            hint = did_you_mean(odd, VERDICTS) if isinstance(odd, str) else ""
            more = f" (or {n * shape.d_tp}: one per request and D TP rank)" if shape.d_tp > 1 else ""
            raise BadInput(f"{where}: [expect] {rel!r}: give one of {', '.join(VERDICTS)} or a list of {n}{more}"
                           f"{hint}")
        expect[rel] = list(wants)
    for f, origin in zip(faults, origins, strict=True):
        if f.d_rank is not None and not 0 <= f.d_rank < shape.d_tp:
            raise BadInput(f"{origin} {f.text()}: D TP rank {f.d_rank} does not exist (decode tp_size "
                           f"{shape.d_tp})")
        if f.rank is not None and not f.rank < shape.p_tp:
            raise BadInput(f"{origin} {f.text()}: P TP rank {f.rank} does not exist (prefill tp_size "
                           f"{shape.p_tp})")
    if vllm is None:
        named = [r for r in expect if r != CORRECTED.name]
        if not named:
            raise BadInput(f"{where}: name the releases (--vllm, or an [expect] table)")
        vllm = ",".join(named)
    models = resolve_many(vllm)
    if mode == "push":
        def has_push(r: Any) -> bool:
            return push_available(r.number)

        if vllm.strip() == "all":  # every modelled release that has push mode (on P TP > D TP: that counts)
            models = [r for r in models if has_push(r) and (shape.p_tp <= shape.d_tp or r.number >= PP_SINCE)]
        for r in models:
            if not has_push(r):
                origin = "--mode push" if flags.get("mode") is not None else f'{where}: [requests] mode = "push"'
                since = ".".join(map(str, PUSH_SINCE))
                raise BadInput(f"{origin}: vLLM {r.name} has no push mode (NixlPushConnector arrived in "
                               f"{since}); name {'.'.join(map(str, PUSH_SINCE[:2]))}+ releases")
    releases = [(r.name, with_policy(line_of(r.version or r.name), policy)) for r in models]
    if mode == "push" and shape.p_tp > shape.d_tp:
        # 0.24/0.25's D calls a pushed request done at the first completion notification; 0.26 counts one per P
        # rank writing into it (push.expected_notifs). With several P ranks per D rank what 0.24/0.25's D finds
        # then is a race between the WRITEs: no verdict to name (docs/requests.md, push mode on TP shapes).
        early = [r for r, ln in releases if not has_pp(ln)]
        if early:
            raise BadInput(f"{where}: {shape.text()} in push mode: vLLM {early[0]}'s D takes a request as done at "
                           "the first P rank's completion notification (0.26 counts one per P rank writing into "
                           "it), so what it decodes races the other WRITEs; name 0.26+ releases")
    if shape.p_tp > shape.d_tp:
        old = [r for r, ln in releases if ln.first < WORLD_SINCE]
        if old:
            raise BadInput(f"{where}: {shape.text()}: vLLM {old[0]} reads no P TP > D TP (its D divides by a zero "
                           "tp_ratio; see `pdcheck handshake`); name 0.14+ releases")
    name = scenario.stem if scenario is not None else "flags"
    return RequestsPlan(where if scenario is not None else "flags", name, str(req.get("issue", "")), releases,
                        Options(n, rate, lease, per, pool, faults, policy, mode=mode, shape=shape).scaled(
                            time_scale(flags.get("time_scale"))), expect)


def time_scale(flag: float | None) -> float:
    """--time-scale, else $PDCHECK_TIME_SCALE, else 1: how much slower than written the run goes."""
    if flag is not None:
        return float(_number("--time-scale", "time scale", flag, *bounds.TIME_SCALE, False))
    raw = os.environ.get(TIME_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{TIME_SCALE_ENV}={raw[:40]!r}: give a number from {bounds.TIME_SCALE[0]:g} to "
                       f"{bounds.TIME_SCALE[1]:g}") from None
    return float(_number(f"${TIME_SCALE_ENV}", "time scale", value, *bounds.TIME_SCALE, False))


def _shape(where: str, doc: dict[str, Any], flags: dict[str, dict[str, int]]) -> Shape:
    """[prefill] / [decode] tp_size and dp_size (handshake scenarios' keys; the rest of those tables belongs to
    `pdcheck handshake`), the shape flags (--prefill-tp ...) over them."""
    from pdcheck.kvsplit import divisible

    got: dict[str, int] = {}
    for side in ("prefill", "decode"):
        table = doc.get(side, {})
        if not isinstance(table, dict):
            raise BadInput(f"{where}: [{side}] must be a table")
        bad = set(table) - {"tp_size", "dp_size"}
        if bad:
            raise BadInput(f"{where}: [{side}] unknown key(s) {', '.join(sorted(bad))} (the request path reads "
                           "tp_size and dp_size)")
        for key in ("tp_size", "dp_size"):
            given = flags.get(side, {}).get(key)
            origin = f"--{side}-{key[:2]}" if given is not None else f"{where}: [{side}]"
            got[f"{side[0]}_{key[:2]}"] = int(_number(origin, key, given if given is not None else table.get(key, 1),
                                                      1, MAX_RANKS, True))
    shape = Shape(got["p_tp"], got["p_dp"], got["d_tp"], got["d_dp"])
    ranks = shape.p_tp * shape.p_dp + shape.d_tp * shape.d_dp
    origin = where if not flags else f"{where} and the shape flags" if doc else "the shape flags"
    if ranks > MAX_RANKS:
        raise BadInput(f"{origin}: {shape.text()} is {ranks} ranks; the request path runs at most {MAX_RANKS}")
    if not divisible(shape.d_tp, shape.p_tp):
        raise BadInput(f"{origin}: {shape.text()}: one TP size must divide the other")
    return shape
