"""vLLM's NixlConnector behind the framework seam: a thin adapter over pdcheck.vllm.plan, handshake, live, report,
probe, serve, fromlogs and the request path (pdcheck.vllm.requests). Every heavy import is inside a method."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdcheck.seam import (
    DoctorContext,
    Framework,
    FromLogsArgs,
    HandshakeArgs,
    Outcome,
    ProbeArgs,
    RequestsArgs,
    ServeArgs,
    SmokeCost,
    SmokeOptions,
    Support,
)
from pdcheck.vllm.requests.faults import NAMES as FAULT_NAMES
from pdcheck.vllm.smoke import NAME, REQUESTS_DIR

FAULTS_EPILOG = """Faults (--fault NAME[:ARGS][:REQ|:p=SHARE], repeatable; REQ: one request,
p=SHARE: that fraction of them picked by --seed, default every one):
slow-decode:SECONDS, drop-notif, delay-notif:SECONDS,
bad-params:out-of-range|reused-ids|wrong-engine|missing-request-id|wrong-tp,
drop-params, restart-p:REQ[:rank=R], read-fail, hold:SECONDS,
heartbeat-loss:SECONDS, abort-d. In push mode drop-notif and delay-notif hit
P's completion notification to D."""


class VLLM(Framework):
    name = NAME
    title = "vLLM"
    flag = "--vllm"
    distribution = "vllm"
    env_prefixes = ("VLLM_NIXL_",)
    scenario_dirs: tuple[str, ...] = ("", REQUESTS_DIR)
    rank_modules: tuple[str, ...] = ("pdcheck.vllm.ranks", "pdcheck.vllm.requests.rank")
    docs = "docs/release-models.md"
    # Every flag of each command is vLLM's (pdcheck grew from it): flags=None.
    commands = {
        "handshake": Support("Release(s) to model: 0.9.1, '0.9.1,0.9.2', or 'all' (default: the scenario's list)."),
        "smoke": Support(),
        "probe": Support("P's vLLM release: only that era's requests are sent. 'auto': read it from --version-url "
                         "first."),
        "serve": Support("The release P speaks (default: the scenario's prefill.vllm, else its first release)."),
        "requests": Support("Release(s): 0.9.1, '0.9.1,0.34.0' or 'all' (default: the scenario's \\[expect] "
                            "releases).", help={"fault": ", ".join(FAULT_NAMES)}, epilog=FAULTS_EPILOG),
        "from-logs": Support(),
    }

    # ------------------------------------------------------------------------------------------ scenario
    # ---- scenario
    def release_line(self, release: str) -> str:
        from pdcheck.vllm.releases import resolve

        return resolve(release, self.flag).name

    def release_table(self) -> Any:
        from pdcheck.vllm.releases import TABLE

        return TABLE

    def load(self, path: Path | None, overrides: dict[str, Any], max_tp: int | None = None) -> Any:
        from pdcheck.vllm import commands

        return commands.load(path, overrides, max_tp)

    # ---- commands (pdcheck/vllm/commands.py)
    def handshake_plan(self, a: HandshakeArgs) -> Any:
        from pdcheck.vllm import commands

        return commands.handshake_plan(a)

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck.vllm import commands

        return commands.handshake_run(plan, show_progress)

    def probe(self, o: ProbeArgs) -> Outcome:
        from pdcheck.vllm import commands

        return commands.probe(o)

    def serve(self, o: ServeArgs) -> int:
        from pdcheck.vllm import commands

        return commands.serve(o)

    def from_logs(self, o: FromLogsArgs) -> Outcome:
        from pdcheck.vllm import commands

        return commands.from_logs(o)

    def requests(self, o: RequestsArgs) -> Outcome:
        from pdcheck.vllm import commands

        return commands.requests(o)

    def doctor_checks(self, env: Mapping[str, str], context: DoctorContext) -> list[Any]:
        from pdcheck.vllm import doctor

        return doctor.checks(env, context)

    # ---- smoke (pdcheck/vllm/smoke.py)
    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        from pdcheck.vllm import smoke

        return smoke.plan(path, options)

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        from pdcheck.vllm import smoke

        return smoke.run(plan, case)

    def smoke_count(self, plan: Any) -> int:
        from pdcheck.vllm import smoke

        return smoke.count(plan)

    def smoke_phase(self, plan: Any) -> str:
        from pdcheck.vllm import smoke

        return smoke.phase(plan)

    def smoke_cost(self, part: Any) -> SmokeCost:
        from pdcheck.vllm import smoke

        return smoke.cost(part)


FRAMEWORK = VLLM()
