"""vLLM's NixlConnector behind the framework seam: a thin adapter over pdcheck.plan, handshake, live, report,
probe, serve, fromlogs and the request path (pdcheck.requests). Every heavy import is inside a method."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput, HarnessError
from pdcheck.frameworks import Framework, HandshakeArgs, Outcome, SmokeCost, SmokeOptions

REQUESTS_PREFIX = "requests-"  # scenarios of `pdcheck requests` (pdcheck.requests.plan's format)
REQUESTS_DIR = "requests"  # ... and every scenario of this subdirectory (the bundled ones live in scenarios/requests)


def _console(stderr: bool = False, **kw: Any) -> Any:
    from pdcheck.console import console

    return console(stderr, **kw)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


class VLLM(Framework):
    name = "vllm"
    title = "vLLM"
    flag = "--vllm"
    distribution = "vllm"
    scenario_dirs: tuple[str, ...] = ("", REQUESTS_DIR)
    rank_modules: tuple[str, ...] = ("pdcheck.handshake_ranks", "pdcheck.requests.rank")
    commands: dict[str, str | None] = {
        "handshake": "Release(s) to model: 0.9.1, '0.9.1,0.9.2', or 'all' (default: the scenario's list).",
        "smoke": None,
        "probe": "P's vLLM release: only that era's requests are sent. 'auto': read it from --version-url first.",
        "serve": "The release P speaks (default: the scenario's prefill.vllm, else its first release).",
        "requests": "Release(s): 0.9.1, '0.9.1,0.34.0' or 'all' (default: the scenario's \\[expect] releases).",
        "from-logs": None,
    }

    # ------------------------------------------------------------------------------------------ scenario
    def release_line(self, release: str) -> str:
        from pdcheck.releases import resolve

        return resolve(release, self.flag).name

    def release_table(self) -> Any:
        from pdcheck.releases import TABLE

        return TABLE

    def load(self, path: Path | None, overrides: dict[str, Any], max_tp: int | None = None) -> Any:
        from pdcheck.bounds import MAX_TP
        from pdcheck.scenario import load

        return load(path, overrides, max_tp or MAX_TP)

    # ----------------------------------------------------------------------------------------- handshake
    def handshake_plan(self, a: HandshakeArgs) -> Any:
        from pdcheck import bounds
        from pdcheck import plan as pl

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
            from pdcheck.scenario import read_toml

            p_doc = read_toml(a.scenario).get("prefill", {}) if a.scenario is not None else {}
            p_over = overrides.get("prefill", {})
            tp_given = "tp_size" in p_over or "tp_size" in p_doc
            if "num_blocks" not in p_over and "num_blocks" not in p_doc:
                overrides = {**overrides, "prefill": {**p_over, "num_blocks": 1}}  # the live P's counts are probed
        if a.from_logs is not None:
            fl, sc = logs_scenario(a.from_logs, overrides, max_tp=a.max_tp)
            report_missing(fl, overrides)
        else:
            sc = self.load(a.scenario, overrides, a.max_tp)
        live = None
        if a.prefill_endpoint is not None:
            from pdcheck.probe import parse_endpoint

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

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck import progress, report

        run_plan, log_dir = plan
        if run_plan.live is not None:
            from pdcheck.live import run as runner
        else:
            from pdcheck.handshake import run as runner
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

    # --------------------------------------------------------------------------------------------- smoke
    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        if is_requests_file(path):
            plan = requests_plan(path, None, {}, [])
            if not plan.expect:
                raise BadInput(f"{path}: expect: no expected outcomes (add an [expect] table)")
            return plan
        from pdcheck.plan import RunOptions, build
        from pdcheck.releases import CORRECTED

        sc = self.load(path, {})
        if not sc.expect:
            raise BadInput(f"{sc.source}: expect: no expected outcomes (add an [expect] table)")
        opts = RunOptions(transfer=options.transfer, hang_timeout_ms=options.hang_timeout_ms)
        return build(sc, ",".join(r for r in sc.expect if r != CORRECTED.name), opts, where=sc.source)

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        from pdcheck.plan import Plan

        return _smoke_handshake(plan, case) if isinstance(plan, Plan) else _smoke_requests(plan, case)

    def smoke_count(self, plan: Any) -> int:
        from pdcheck.plan import Plan

        return len(plan.scenario.expect if isinstance(plan, Plan) else plan.expect)

    def smoke_phase(self, plan: Any) -> str:
        from pdcheck.plan import Plan

        return "handshake" if isinstance(plan, Plan) else "requests"

    def smoke_cost(self, part: Any) -> SmokeCost:
        from pdcheck.plan import Plan

        if not isinstance(part, Plan):  # one P and one D rank; each release line (and corrected) in turn
            from pdcheck.requests.model import run_end

            o = part.options
            per_line = run_end(o.requests, o.rate, o.faults, o.settle_s) + (o.lease_s or 0.5)
            return SmokeCost(ranks=2, seconds=(len(part.releases) + 1) * per_line)
        sc = part.scenario
        # Each D rank runs the releases one after another: a hanging one waits out the whole hang timeout.
        hangs = sum(1 for exp in sc.expect.values() if "hang" in (exp if isinstance(exp, list) else [exp]))
        groups = max(1, len(part.dp) + len(part.dp_idle))
        return SmokeCost(ranks=sc.prefill.tp_size + sc.decode.tp_size,
                         seconds=groups * (0.5 + 0.1 * (sc.prefill.tp_size + sc.decode.tp_size))
                         + hangs * part.options.hang_timeout_ms / 1000)

    # --------------------------------------------------------------------------------------------- probe
    def probe(self, o: dict[str, Any]) -> Outcome:
        import msgspec

        from pdcheck import bounds as b
        from pdcheck import probe as pr
        from pdcheck import releases, verdict

        unsupported_probe = {"--decode-sglang": o.get("decode_sglang")}
        for flag, val in unsupported_probe.items():
            if val is not None:
                raise BadInput(f"{flag}: not available for vLLM (it goes with --sglang)")
        vllm = o["releases"]
        if vllm is None:
            raise BadInput("probe: name the prefill's release: --vllm RELEASE (or --sglang RELEASE)")
        host, port = pr.parse_endpoint(o["endpoint"])
        source = "--vllm"
        timeout, max_tp, tp_size = o["timeout"], o["max_tp"], o["tp_size"]
        b.check_seconds("--timeout", timeout, b.PROBE_TIMEOUT_S)
        b.check_max_tp(max_tp)
        if tp_size is not None and tp_size > max_tp:
            raise BadInput(f"--prefill-tp: {tp_size} is above --max-tp {max_tp}")
        if vllm.strip() == "auto":
            if o["version_url"] is None:
                raise BadInput(
                    "--vllm auto needs --version-url (P's API server, e.g. http://HOST:8000/version): no order of "
                    "trial requests is safe on a live side channel (raw bytes kill an F-H listener, a 2-tuple "
                    "kills H, a 3-tuple kills F-G)")
            vllm = pr.release_from_url(o["version_url"], timeout)
            source = o["version_url"]
        release = releases.resolve(vllm)
        if release is releases.CORRECTED:
            raise BadInput("--vllm: name the release P runs (corrected is not a release)")
        dp_rank, dp_size = o["dp_rank"], o["dp_size"]
        if dp_rank < 0 or (tp_size is not None and tp_size < 1):
            raise BadInput("--dp-rank must be >= 0 and --prefill-tp >= 1")
        if not 1 <= dp_size <= b.MAX_DP_SIZE:
            raise BadInput(f"--dp-size: {dp_size} is out of range (1 to {b.MAX_DP_SIZE})")
        pp_size = o.get("pp_size")
        if pp_size is not None and not 1 <= pp_size <= b.MAX_PP_SIZE:
            raise BadInput(f"--pp-size: {pp_size} is out of range (1 to {b.MAX_PP_SIZE})")
        decode_sc, where = pr.decode_config(o["scenario"], o["overrides"])
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
                    pr.render(r, out)
                for n in notes:
                    out.print(f"[red]DP:[/] {n}", highlight=False)
                out.print(f"{dp_size} DP ranks; exit {code}")

            return Outcome(code, dp_rep, render_dp)
        rep = pr.run(host, port, release, dp_rank=dp_rank, **kw)
        return Outcome(rep.exit_code, rep, lambda out: pr.render(rep, out))

    # --------------------------------------------------------------------------------------------- serve
    def serve(self, o: dict[str, Any]) -> int:
        from pdcheck import serve as sv
        from pdcheck.bounds import MIN_BASE_PORT, SERVE_DURATION_S, check_seconds
        from pdcheck.plan import ServeOptions, build_serve
        from pdcheck.progress import log_line
        from pdcheck.releases import resolve
        from pdcheck.scenario import load, read_toml

        port, tag_blocks, duration, api_port = o["port"], o["tag_blocks"], o["duration"], o["api_port"]
        sc = sv.load_prefill(o["scenario"], o["overrides"], read_toml, load)
        name = o["releases"] if o["releases"] is not None else sc.prefill.vllm or sc.vllm[0]
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
        json_out = o["json_out"]
        return sv.run(plan, lambda doc: sv._print_ready(doc, json_out), log_line)

    # ----------------------------------------------------------------------------------------- from-logs
    def from_logs(self, o: dict[str, Any]) -> Outcome:
        from pdcheck import fromlogs

        output, overrides = o["output"], o["overrides"]
        fl, _sc = logs_scenario((o["prefill_log"], o["decode_log"]), overrides, o["dp_rank"])
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

    # ------------------------------------------------------------------------------------------ requests
    def requests(self, o: dict[str, Any]) -> Outcome:
        plan = requests_plan(o["scenario"], o["releases"], o["flags"], o["faults"], o.get("shape") or {})
        plot = o["plot"]
        if plot is not None:
            from pdcheck import figure

            figure.check(plot)  # before anything runs
        from pdcheck import progress

        with progress.stderr_progress(enabled=not o.get("json_out", False)) as tick:
            rep = requests_execute(plan, tick)
        if plot is not None:
            from pdcheck.requests import plot as plotting

            plotting.write(rep, plot)
            _console_err().print(f"pdcheck: wrote the plot to {plot}", markup=False)

        def render(console: Any) -> None:
            from pdcheck.requests.report import render as req_render

            req_render(rep, console, every=bool(o.get("all")))

        return Outcome(rep.exit_code, rep, render)


def _console_err() -> Any:
    return _console(stderr=True, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------- helpers
def logs_scenario(logs: tuple[Path, Path], overrides: dict[str, Any], dp_rank: int | None = None,
                  max_tp: int | None = None) -> Any:
    """(FromLogs, Scenario) for a pair of logs, flags merged in; the missing-field report goes to stderr."""
    from pdcheck import fromlogs
    from pdcheck.bounds import MAX_TP
    from pdcheck.scenario import decode_scenario

    p_log, d_log = logs
    fl = fromlogs.from_files(p_log, d_log, dp_rank)
    fromlogs.require(fl, overrides, str(p_log), str(d_log))
    sc = decode_scenario(fromlogs.scenario_doc(fl, overrides), f"scenario from {p_log} and {d_log}",
                         max_tp or MAX_TP)
    return fl, sc


def report_missing(fl: Any, overrides: dict[str, Any]) -> None:
    from pdcheck import fromlogs

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

    from pdcheck.messages import Inject

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


def is_requests_file(path: Path) -> bool:
    """A `pdcheck requests` scenario: requests-*.toml, or any file of a requests/ directory."""
    return path.name.startswith(REQUESTS_PREFIX) or path.parent.name == REQUESTS_DIR


def requests_files(directory: Path) -> list[Path]:
    """`pdcheck requests` scenarios: requests-*.toml here, and every *.toml of ./requests (or of this directory
    when it is a requests/ directory)."""
    try:
        if directory.name == REQUESTS_DIR:
            return sorted(directory.glob("*.toml"))
        sub = directory / REQUESTS_DIR
        return sorted({*directory.glob(f"{REQUESTS_PREFIX}*.toml"), *(sub.glob("*.toml") if sub.is_dir() else [])})
    except OSError:
        return []


def requests_plan(scenario: Path | None, vllm: str | None, flags: dict[str, Any], faults: list[str],
                  shape: dict[str, dict[str, int]] | None = None) -> Any:
    from pdcheck.requests.plan import build
    from pdcheck.scenario import read_toml

    doc = read_toml(scenario) if scenario is not None else {}
    return build(scenario, doc, vllm, flags, faults, shape)


def requests_execute(plan: Any, tick: Any = None) -> Any:
    from pdcheck.requests import report
    from pdcheck.requests.run import run

    return report.build(plan, run(plan.releases, plan.options, tick))


def _smoke_requests(plan: Any, case: Callable[..., Any]) -> list[Any]:
    """One request-path scenario: a case per [expect] release (verdict per request)."""
    t0 = time.perf_counter()
    rep = requests_execute(plan)
    secs = time.perf_counter() - t0
    return [case(rep.scenario, plan.source, e.release, e.passed, e.expected, e.got, secs,
                 "" if e.passed else ", ".join(f"request {i}: {g} (expected {w})" for i, (g, w) in
                                               enumerate(zip(e.got, e.expected, strict=False)) if g != w)
                 or f"{len(e.got)} requests reported, {len(e.expected)} expected", framework=VLLM.name)
            for e in rep.expectations]


def _smoke_handshake(plan: Any, case: Callable[..., Any]) -> list[Any]:
    from pdcheck import handshake as hs
    from pdcheck import report
    from pdcheck.releases import CORRECTED, resolve

    sc = plan.scenario
    t0 = time.perf_counter()
    try:
        rep = report.build(hs.run(plan))
    except HarnessError as exc:  # this scenario could not run (a port taken, a rank that never started): its
        # cases fail with the reason, and the job goes on to the other scenarios
        secs = time.perf_counter() - t0
        return [case(sc.name, sc.source, release, False, _want(sc, exp), [], secs, f"harness error: {exc}",
                     framework=VLLM.name) for release, exp in sc.expect.items()]
    secs = time.perf_counter() - t0
    cases = []
    for release, exp in sc.expect.items():
        want = _want(sc, exp)
        got = rep.matrix.get(resolve(release).name if release != CORRECTED.name else release, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            diff = [f"D{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
            msg = ", ".join(diff) or f"{len(got)} decode ranks reported, {len(want)} expected"
        cases.append(case(sc.name, sc.source, release, got == want and not rep.harness_errors, want, got, secs, msg,
                          framework=VLLM.name))
    return cases


def _want(sc: Any, exp: str | list[str]) -> list[str]:
    """A release's expected verdict per decode rank (one verdict: the same for every rank)."""
    return list(exp) if isinstance(exp, list) else [exp] * (sc.decode.tp_size * sc.decode.dp_size)


FRAMEWORK = VLLM()
