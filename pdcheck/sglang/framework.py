"""SGLang's NIXL disaggregation behind the framework seam: a thin adapter over pdcheck.sglang (scenario, plan,
runner, report, probe, serve, fromlogs, smoke). Every heavy import is inside a method."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcheck.seam import (
    Framework,
    FromLogsArgs,
    HandshakeArgs,
    Outcome,
    ProbeArgs,
    ServeArgs,
    SmokeCost,
    SmokeOptions,
    Support,
)

# The scenario flags whose keys an SGLang scenario has (pdcheck/sglang/scenario.py SgInstance): TP per side, and the
# model's layers, KV heads, head dim and dtype, for both sides or one.
_MODEL = ("layers", "kv_heads", "head_dim", "dtype")
SCENARIO_FLAGS = frozenset({"prefill_tp", "decode_tp", *_MODEL, *(f"{side}_{key}" for side in ("prefill", "decode")
                                                                  for key in _MODEL)})


class SGLang(Framework):
    name = "sglang"
    title = "SGLang"
    flag = "--sglang"
    distribution = "sglang"
    env_prefixes = ("SGLANG_DISAGGREGATION_",)
    scenario_dirs: tuple[str, ...] = ("sglang",)
    rank_modules: tuple[str, ...] = ("pdcheck.sglang.ranks",)
    docs = "docs/sglang.md"
    commands = {
        "handshake": Support("SGLang release(s) to model instead of vLLM: 0.5.8, '0.4.7,0.5.23' or 'all' (or "
                             "framework = \"sglang\" in the scenario).",
                             SCENARIO_FLAGS | {"prefill_endpoint"}),
        "smoke": Support(flags=frozenset()),
        "probe": Support("Instead of --vllm: HOST:PORT is an SGLang prefill's bootstrap server (http://HOST:8998), "
                         "read with GETs only; its release, or 'auto'.", frozenset({"decode_releases"})),
        "serve": Support("Serve fake SGLang P ranks of this release and their bootstrap server (--port: its port) "
                         "instead of vLLM's.", frozenset({"port"})),
        "from-logs": Support("The logs are SGLang servers' (their server_args line): write an SGLang scenario for "
                             "these releases.", frozenset()),
    }

    def release_line(self, release: str) -> str:
        from pdcheck.sglang.releases import resolve

        return resolve(release, self.flag).name

    def release_table(self) -> Any:
        from pdcheck.sglang.releases import TABLE

        return TABLE

    def load(self, path: Path | None, overrides: dict[str, Any]) -> Any:
        from pdcheck.sglang.scenario import load

        return load(path, overrides)

    # ----------------------------------------------------------------------------------------- handshake
    def handshake_plan(self, a: HandshakeArgs) -> Any:
        from pdcheck.sglang import plan as sp

        live = None
        if a.prefill_endpoint is not None:
            from pdcheck.sglang.probe import parse_url

            live = sp.LiveBootstrap(*parse_url(a.prefill_endpoint))
        return sp.build(self.load(a.scenario, a.overrides), a.releases,
                        sp.SgOptions(hang_timeout_s=a.hang_timeout, start_timeout_s=a.timeout,
                                     run_timeout_s=a.timeout), live)

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck.sglang import report as sr
        from pdcheck.sglang import runner

        rep = sr.build(runner.run(plan))
        return Outcome(rep.exit_code, rep, lambda console: sr.render(rep, console))

    # --------------------------------------------------------------------------------------------- smoke
    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        from pdcheck.sglang import smoke as sg

        return sg.plan_of(path, options.hang_timeout_ms)

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        from pdcheck.sglang import smoke as sg

        return sg.run_one(plan, case)

    def smoke_count(self, plan: Any) -> int:
        return len(plan.scenario.expect)

    def smoke_split(self, plan: Any) -> list[Any]:
        from pdcheck.sglang import smoke as sg

        return sg.split(plan)

    def smoke_cost(self, part: Any) -> SmokeCost:
        from pdcheck.sglang import smoke as sg

        return sg.cost(part)

    # ------------------------------------------------------------------------------------- probe, serve
    def probe(self, o: ProbeArgs) -> Outcome:
        from pdcheck.sglang import probe as sp

        rep = sp.probe_report(o.endpoint, o.releases, o.decode_releases, o.scenario, o.timeout)
        return Outcome(rep.exit_code, rep, lambda console: sp.render(rep, console))

    def serve(self, o: ServeArgs) -> int:
        from pdcheck.sglang.serve import command

        release = o.releases
        if release is None:  # the scenario's: its prefill's own release, else its first
            sc = self.load(o.scenario, {})
            release = sc.prefill.sglang or sc.sglang[0]
        return command(o.scenario, release, o.port, o.duration, o.json_out)

    # ----------------------------------------------------------------------------------------- from-logs
    def from_logs(self, o: FromLogsArgs) -> Outcome:
        import sys

        from pdcheck.console import console
        from pdcheck.sglang import fromlogs as sgl
        from pdcheck.sglang.releases import resolve_many

        output = o.output
        names = [r.name for r in resolve_many(o.releases)]
        p_f, d_f = sgl.parse(o.prefill_log, "prefill"), sgl.parse(o.decode_log, "decode")
        text = sgl.to_toml(p_f, d_f, names)
        doc = {"framework": self.name, "prefill": p_f, "decode": d_f, "sglang": names,
               "notes": p_f.notes + d_f.notes, "output": str(output) if output is not None else None}
        from rich.markup import escape

        for note in p_f.notes + d_f.notes:
            console(True, highlight=False).print(f"note: {escape(note)}")

        def render(_console: Any) -> None:
            if output is None:
                sys.stdout.write(text)

        return Outcome(0, doc, render, text)


FRAMEWORK = SGLang()
