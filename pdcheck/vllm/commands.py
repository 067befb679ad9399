"""vLLM's commands behind its adapter (pdcheck/vllm/framework.py): each command's typed contract (pdcheck.seam)
turned into a plan, run, and rendered. Every heavy import is inside a function (help and completion load the
adapter, not these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput
from pdcheck.seam import (
    FromLogsArgs,
    HandshakeArgs,
    Outcome,
    ProbeArgs,
    RequestsArgs,
    ServeArgs,
)


def _console(stderr: bool = False, **kw: Any) -> Any:
    from pdcheck.console import console

    return console(stderr, **kw)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _console_err() -> Any:
    return _console(stderr=True, highlight=False, soft_wrap=True)


def load(path: Path | None, overrides: dict[str, Any], max_tp: int | None = None) -> Any:
    from pdcheck.bounds import MAX_TP
    from pdcheck.vllm.scenario import load

    return load(path, overrides, max_tp or MAX_TP)


def handshake_plan(a: HandshakeArgs) -> Any:
    from pdcheck import bounds
    from pdcheck.vllm import plan as pl

    bounds.check_max_tp(a.max_tp)
    if a.device not in ("cpu", "cuda"):
        raise BadInput(f"--device: expected cpu or cuda, got {a.device!r}")
    if a.from_logs is not None and a.scenario is not None:
        raise BadInput("give a scenario file or --from-logs, not both")
    overrides = a.overrides
    if a.prefill_release is not None:
        overrides = {**overrides, "prefill": {**overrides.get("prefill", {}), "vllm": a.prefill_release}}
    tp_given = True
    if a.prefill_endpoint is not None and a.from_logs is None:
        from pdcheck.scenariofile import read_toml

        p_doc = read_toml(a.scenario).get("prefill", {}) if a.scenario is not None else {}
        p_over = overrides.get("prefill", {})
        tp_given = "tp_size" in p_over or "tp_size" in p_doc
        if "num_blocks" not in p_over and "num_blocks" not in p_doc:
            overrides = {**overrides, "prefill": {**p_over, "num_blocks": 1}}  # the live P's counts are probed
    if a.from_logs is not None:
        fl, sc = logs_scenario(a.from_logs, overrides, max_tp=a.max_tp)
        report_missing(fl, overrides)
    else:
        sc = load(a.scenario, overrides, a.max_tp)
    live = None
    if a.prefill_endpoint is not None:
        from pdcheck.vllm.probe import parse_endpoint

        live = pl.LiveP(*parse_endpoint(a.prefill_endpoint, "--prefill-endpoint"), tp_given=tp_given)
    options = pl.RunOptions(device=a.device, transfer=a.transfer, hang_timeout_ms=int(a.hang_timeout * 1000),
                            run_timeout_s=a.timeout, start_timeout_s=a.timeout,
                            inject=parse_inject(a.inject or [], sc.prefill.tp_size), max_tp=a.max_tp)
    run_plan = pl.build(sc, a.releases, options, live=live, ray=a.ray)  # releases resolved, ports laid out
    bounds.check_device(a.device)
    if a.ray is not None:
        if a.prefill_endpoint is not None:
            raise BadInput("--ray places fake P and D ranks; with --prefill-endpoint there is no fake P "
                           "(drop one)")
        from pdcheck.launcher import check_ray

        check_ray(a.ray)
    if a.log_dir is not None:
        from pdcheck import lifecycle

        lifecycle.keep_rank_logs(a.log_dir)
    return run_plan, a.log_dir


def handshake_run(plan: Any, show_progress: bool) -> Outcome:
    from pdcheck import progress
    from pdcheck.vllm import report

    run_plan, log_dir = plan
    if run_plan.live is not None:
        from pdcheck.vllm.live import run as runner
    else:
        from pdcheck.vllm.handshake import run as runner
    with progress.stderr_progress(enabled=show_progress) as tick:
        rep = report.build(runner(run_plan.with_progress(tick)))

    def render(console: Any) -> None:
        if len(run_plan.releases) > 2:
            report.render_matrix(rep, console)
            report.render_live(rep, console)
            for e in rep.harness_errors:
                console.print(f"[red]harness:[/] {_escape(e)}")
            # the per-rank view is worth a second run only where a release fails
            more = f" Per-rank asserts and transfer proof: --vllm {rep.fails[0]}" if rep.fails else ""
            console.print(f"[dim]{rep.timings.total_s:.2f} s; exit {rep.exit_code}.{more}[/]")
        else:
            report.render(rep, console)
        _native_note(log_dir)

    return Outcome(rep.exit_code, rep, render)


def probe(o: ProbeArgs) -> Outcome:
    import msgspec

    from pdcheck import bounds as b
    from pdcheck import verdict
    from pdcheck.vllm import probe as pr
    from pdcheck.vllm import probe_render, releases

    if o.decode_releases is not None:
        raise BadInput("--decode-releases: vLLM's hazards are judged against the --scenario's decode")
    vllm = o.releases
    if vllm is None:
        raise BadInput("probe: name the prefill's release: --vllm RELEASE (or --sglang RELEASE)")
    host, port = pr.parse_endpoint(o.endpoint)
    source = "--vllm"
    timeout, max_tp, tp_size = o.timeout, o.max_tp, o.tp_size
    b.check_seconds("--timeout", timeout, b.PROBE_TIMEOUT_S)
    b.check_max_tp(max_tp)
    if tp_size is not None and tp_size > max_tp:
        raise BadInput(f"--prefill-tp: {tp_size} is above --max-tp {max_tp}")
    if vllm.strip() == "auto":
        if o.version_url is None:
            raise BadInput(
                "--vllm auto needs --version-url (P's API server, e.g. http://HOST:8000/version): no order of "
                "trial requests is safe on a live side channel (raw bytes kill an F-H listener, a 2-tuple "
                "kills H, a 3-tuple kills F-G)")
        vllm = release_from_url(o.version_url, timeout)
        source = o.version_url
    release = releases.resolve(vllm)
    if release is releases.CORRECTED:
        raise BadInput("--vllm: name the release P runs (corrected is not a release)")
    dp_rank, dp_size = o.dp_rank, o.dp_size
    if dp_rank < 0 or (tp_size is not None and tp_size < 1):
        raise BadInput("--dp-rank must be >= 0 and --prefill-tp >= 1")
    if not 1 <= dp_size <= b.MAX_DP_SIZE:
        raise BadInput(f"--dp-size: {dp_size} is out of range (1 to {b.MAX_DP_SIZE})")
    pp_size = o.pp_size
    if pp_size is not None and not 1 <= pp_size <= b.MAX_PP_SIZE:
        raise BadInput(f"--pp-size: {pp_size} is out of range (1 to {b.MAX_PP_SIZE})")
    decode_sc, where = decode_config(o.scenario, o.overrides)
    kw = dict(tp_size=tp_size, timeout_ms=max(1, int(timeout * 1000)), decode_sc=decode_sc, decode_from=where,
              release_source=source, max_tp=max_tp, pp_size=pp_size)
    if dp_size > 1:
        reps = [pr.run(host, port, release, dp_rank=k, **kw) for k in range(dp_rank, dp_rank + dp_size)]
        notes = pr.dp_notes(reps, dp_size, release)
        code = verdict.exit_code([r.exit_code == 0 for r in reps] + [not notes])
        dp_rep = pr.DpProbeReport(endpoint=f"{host}:{port}", dp_size=dp_size, dp_ranks=reps, notes=notes,
                                  exit_code=code, verdicts=[
                                      msgspec.structs.replace(v, rank=f"DP{r.dp_rank}/{v.rank}")
                                      for r in reps for v in r.verdicts])

        def render_dp(out: Any) -> None:
            for r in reps:
                probe_render.render(r, out)
            for n in notes:
                out.print(f"[red]DP:[/] {n}", highlight=False)
            out.print(f"{dp_size} DP ranks; exit {code}")

        return Outcome(code, dp_rep, render_dp)
    rep = pr.run(host, port, release, dp_rank=dp_rank, **kw)
    return Outcome(rep.exit_code, rep, lambda out: probe_render.render(rep, out))


def serve(o: ServeArgs) -> int:
    from pdcheck.bounds import MIN_BASE_PORT, SERVE_DURATION_S, check_seconds
    from pdcheck.progress import log_line
    from pdcheck.scenariofile import read_toml
    from pdcheck.vllm import serve as sv
    from pdcheck.vllm.plan import TAG_BLOCKS, ServeOptions, build_serve
    from pdcheck.vllm.releases import resolve
    from pdcheck.vllm.scenario import load

    port, duration, api_port = o.port, o.duration, o.api_port
    tag_blocks = TAG_BLOCKS if o.tag_blocks is None else o.tag_blocks
    sc = sv.load_prefill(o.scenario, o.overrides, read_toml, load)
    name = o.releases if o.releases is not None else sc.prefill.vllm or sc.vllm[0]
    from pdcheck.releaseline import is_corrected

    if "," in name or name.strip() == "all" or is_corrected(name):
        raise BadInput(f"--vllm: serve speaks one release, got {name!r}")
    release = resolve(name)
    if port is not None and not MIN_BASE_PORT <= port <= 65535:
        raise BadInput(f"--port: {port} is outside {MIN_BASE_PORT}-65535")
    if tag_blocks < 0:
        raise BadInput("--tag-blocks must be >= 0")
    if duration is not None:
        check_seconds("--duration", duration, SERVE_DURATION_S)  # nan would end the run at once
    if api_port is not None and not 0 <= api_port <= 65535:
        raise BadInput(f"--api-port: {api_port} is not a port")
    plan = build_serve(sc, release, ServeOptions(port=port, tag_blocks=tag_blocks, duration_s=duration,
                                                 api_port=api_port))
    return sv.run(plan, lambda doc: sv._print_ready(doc, o.json_out), log_line)


def from_logs(o: FromLogsArgs) -> Outcome:
    from pdcheck.vllm import fromlogs

    output, overrides = o.output, o.overrides
    fl, _sc = logs_scenario((o.prefill_log, o.decode_log), overrides, o.dp_rank)
    text = fromlogs.to_toml(fl, overrides)
    doc = {"scenario": fromlogs.scenario_doc(fl, overrides), "sources": fl.sources,
           "missing": fromlogs.missing_report(fl, overrides), "notes": fl.notes,
           "output": str(output) if output is not None else None}

    def render(_console: Any) -> None:
        import sys

        if output is None:
            sys.stdout.write(text)
        else:
            import shlex

            # soft_wrap: the command stays one line to copy, however narrow the terminal.
            _console_err().print(f"wrote {output}; run it with: pdcheck handshake {shlex.quote(str(output))}",
                                 markup=False)
        report_missing(fl, overrides)

    return Outcome(0, doc, render, text)


def requests(o: RequestsArgs) -> Outcome:
    plan = requests_plan(o.scenario, o.releases, o.flags, o.faults, o.overrides)
    plot = o.plot
    if plot is not None:
        from pdcheck import figure

        figure.check(plot)  # before anything runs
    from pdcheck import progress

    with progress.stderr_progress(enabled=not o.json_out) as tick:
        rep = requests_execute(plan, tick)
    if plot is not None:
        from pdcheck.vllm.requests import plot as plotting

        plotting.write(rep, plot)
        _console_err().print(f"pdcheck: wrote the plot to {plot}", markup=False)

    def render(console: Any) -> None:
        from pdcheck.vllm.requests.report import render as req_render

        req_render(rep, console, every=o.every)

    return Outcome(rep.exit_code, rep, render)


def logs_scenario(logs: tuple[Path, Path], overrides: dict[str, Any], dp_rank: int | None = None,
                  max_tp: int | None = None) -> Any:
    """(FromLogs, Scenario) for a pair of logs, flags merged in; the missing-field report goes to stderr."""
    from pdcheck.bounds import MAX_TP
    from pdcheck.vllm import fromlogs
    from pdcheck.vllm.scenario import decode_scenario

    p_log, d_log = logs
    fl = fromlogs.from_files(p_log, d_log, dp_rank)
    fromlogs.require(fl, overrides, str(p_log), str(d_log))
    sc = decode_scenario(fromlogs.scenario_doc(fl, overrides), f"scenario from {p_log} and {d_log}",
                         max_tp or MAX_TP)
    return fl, sc


def report_missing(fl: Any, overrides: dict[str, Any]) -> None:
    from pdcheck.vllm import fromlogs

    lines = fromlogs.missing_report(fl, overrides)
    if lines:
        err = _console_err()
        err.print("[yellow]not in the logs[/] (the scenario default is used):")
        for ln in lines:
            err.print(f"  {ln}", markup=False)


def _native_note(log_dir: Path | None) -> None:
    """One line per distinct NIXL error the ranks logged (their logs, not the terminal, get NIXL's C++ lines):
    these come from the READs the report shows refused."""
    from pdcheck import lifecycle

    found = lifecycle.native_errors(lifecycle.rank_log_dirs())
    if not found:
        return
    where = f"in {log_dir}" if log_dir is not None else "--log-dir DIR keeps them"
    console = _console(highlight=False)
    console.print(f"[dim]NIXL's own error lines in the rank logs ({_escape(where)}), from the refused READs "
                  "above:[/]")
    for msg, ranks in found.items():
        console.print(f"[dim]  {', '.join(ranks)}: {_escape(msg)}[/]")


def parse_inject(items: list[str], p_tp: int) -> Any:
    import re

    from pdcheck.vllm.messages import Inject

    die, mute, corrupt = [], [], []
    num = re.compile(r"[0-9]{1,9}", re.ASCII)
    for item in items:
        parts = item.split(":")
        try:
            if not all(num.fullmatch(x) for x in [parts[1][1:], *parts[2:]]) or int(parts[1][1:]) >= p_tp:
                raise ValueError
            if parts[0] in ("die", "mute") and len(parts) == 2 and parts[1].startswith("P"):
                (die if parts[0] == "die" else mute).append(int(parts[1][1:]))
            elif parts[0] == "corrupt" and len(parts) == 4 and parts[1].startswith("P"):
                corrupt.append((int(parts[1][1:]), int(parts[2]), int(parts[3])))
            else:
                raise ValueError
        except (ValueError, IndexError):
            raise BadInput(f"--inject: {item!r} is not die:P<r>, mute:P<r> or corrupt:P<r>:<region>:<block>") from None
    return Inject(die_p=die, mute_p=mute, corrupt=corrupt)


def requests_plan(scenario: Path | None, vllm: str | None, flags: dict[str, Any], faults: list[str],
                  shape: dict[str, dict[str, int]] | None = None) -> Any:
    from pdcheck.scenariofile import read_toml
    from pdcheck.vllm.requests.plan import build

    doc = read_toml(scenario) if scenario is not None else {}
    return build(scenario, doc, vllm, flags, faults, shape)


def requests_execute(plan: Any, tick: Any = None) -> Any:
    from pdcheck.vllm.requests import report
    from pdcheck.vllm.requests.run import run

    return report.build(plan, run(plan.releases, plan.options, tick))


def release_from_url(url: str, timeout_s: float) -> str:
    """`--vllm auto`: the release P's API server reports (GET /version -> {"version": "0.11.1"}). Out of band:
    no side-channel request is sent until the era is known."""
    import msgspec

    from pdcheck import bounds as b
    from pdcheck.errors import HarnessError
    from pdcheck.netio import PeerError, http_get

    if not url.startswith(("http://", "https://")):
        raise BadInput(f"--version-url: {url!r} is not an http(s) URL")
    try:
        # One deadline for connect, headers and body together; at most 64 KiB of body (netio).
        doc = msgspec.json.decode(http_get(url, timeout_s))
    except PeerError as exc:
        raise HarnessError(f"--vllm auto: cannot read the release from {url}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise HarnessError(f"--vllm auto: {url} did not answer JSON: {exc}") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, str) or len(version) > b.MAX_PEER_STR:
        raise HarnessError(f"--vllm auto: {url} answered without a \"version\" string")
    return version


def decode_config(scenario: Path | None, overrides: dict[str, Any]) -> tuple[Any, str | None]:
    """The decode side to evaluate against: a scenario and/or the scenario flags; (None, None) when no decode
    fact is given. The [prefill] table and prefill flags supply what the wire lacks (heads, dtype, model);
    P's advertised facts replace the rest."""
    from pdcheck.scenariofile import read_toml
    from pdcheck.vllm.scenario import load

    if scenario is None and "decode" not in overrides:
        return None, None
    over = {k: dict(v) for k, v in overrides.items()}
    has_p = "num_blocks" in over.get("prefill", {}) or (
        scenario is not None and "num_blocks" in read_toml(scenario).get("prefill", {}))
    if not has_p:
        over.setdefault("prefill", {})["num_blocks"] = 1  # replaced by what P advertises
    sc = load(scenario, over)
    return sc, str(scenario) if scenario is not None else "flags"
