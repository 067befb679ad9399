"""TensorRT-LLM's disaggregated KV-cache transceivers behind the framework seam: a thin adapter over
pdcheck.trtllm (scenario, plan, runner, report, smoke, probe, serve, doctor). Every heavy import is inside a
method. No `scenario from-logs`: TensorRT-LLM's start-up logs carry tokens per block and the PP layer counts, not
the KV heads, head dim, dtype or TP size (docs/trtllm-protocol.md T76-T78; docs/trtllm.md says more)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdcheck.seam import (
    Framework,
    HandshakeArgs,
    Outcome,
    ProbeArgs,
    ServeArgs,
    SmokeCost,
    SmokeOptions,
    Support,
)

# The shared scenario flags a TensorRT-LLM scenario has keys for (pdcheck/trtllm/scenario.py: prefill is [ctx],
# decode is [gen], block_size is tokens_per_block).
_MODEL = ("block_size", "layers", "kv_heads", "head_dim", "dtype")
SCENARIO_FLAGS = frozenset({"prefill_tp", "decode_tp", "prefill_blocks", "decode_blocks", *_MODEL,
                            *(f"{side}_{key}" for side in ("prefill", "decode") for key in _MODEL)})


class TensorRTLLM(Framework):
    name = "trtllm"
    title = "TensorRT-LLM"
    flag = "--trtllm"
    distribution = "tensorrt-llm"
    env_prefixes = ("TRTLLM_", "UCX_")
    scenario_dirs: tuple[str, ...] = ("trtllm",)
    rank_modules: tuple[str, ...] = ("pdcheck.trtllm.ctx", "pdcheck.trtllm.gen")
    docs = "docs/trtllm.md"
    commands = {
        "handshake": Support("TensorRT-LLM era(s) to model: E1-E5, W1a, W1b, W2a, W2b, W3, a release (1.2.1, "
                             "1.3.0rc5: resolved to its era by dates), a comma list, or 'all' (or framework = "
                             "\"trtllm\" in the scenario).", SCENARIO_FLAGS | {"prefill_endpoint"}),
        "smoke": Support(flags=frozenset()),
        "probe": Support("Instead of --vllm: HOST:PORT (or tcp://HOST:PORT) is a TensorRT-LLM ctx's "
                         "disagg_info_endpoint, asked REQUEST_INSTANCE_INFO only; its wire era (W1a ... W3) or "
                         "'auto'.", SCENARIO_FLAGS),
        "serve": Support("Serve fake TensorRT-LLM ctx ranks of this wire era (W1a ... W3, or a 1.4 release) and "
                         "their info endpoint (--port) instead of vLLM's.", SCENARIO_FLAGS | {"port"}),
    }

    def release_line(self, release: str) -> str:
        from pdcheck.trtllm.eras import resolve

        return resolve(release, self.flag).line.name

    def release_table(self) -> Any:
        from pdcheck.trtllm.eras import TABLE

        return TABLE

    def load(self, path: Path | None, overrides: dict[str, Any]) -> Any:
        from pdcheck.trtllm.scenario import load

        return load(path, overrides)

    # ----------------------------------------------------------------------------------------- handshake
    def handshake_plan(self, a: HandshakeArgs) -> Any:
        from pdcheck.trtllm import plan as tp

        sc = self.load(a.scenario, a.overrides)
        options = tp.TrtOptions(cap_s=max(10.0, 5 * a.hang_timeout), start_timeout_s=a.timeout,
                                run_timeout_s=a.timeout)
        if a.prefill_endpoint is not None:
            from pdcheck.trtllm import probe

            return probe.live_plan(sc, a.releases, a.prefill_endpoint, a.hang_timeout, options)
        return tp.build(sc, a.releases, options)

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck.trtllm import report as tr
        from pdcheck.trtllm import runner

        if plan.live is not None:
            from pdcheck.trtllm import probe

            res = probe.run_live(plan)
        else:
            res = runner.run(plan)
        rep = tr.build(res)
        return Outcome(rep.exit_code, rep, lambda console: tr.render(rep, console))

    # --------------------------------------------------------------------------------------------- smoke
    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        from pdcheck.trtllm import smoke as ts

        return ts.plan_of(path, options.hang_timeout_ms)

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        from pdcheck.trtllm import smoke as ts

        return ts.run_one(plan, case)

    def smoke_count(self, plan: Any) -> int:
        return len(plan.scenario.expect)

    def smoke_cost(self, part: Any) -> SmokeCost:
        from pdcheck.trtllm import smoke as ts

        return ts.cost(part)

    # ------------------------------------------------------------------------------------- probe, serve
    def probe(self, o: ProbeArgs) -> Outcome:
        from pdcheck.trtllm import probe as tp

        rep = tp.probe_report(o.endpoint, o.releases, o.scenario, o.overrides, o.timeout)
        return Outcome(rep.exit_code, rep, lambda console: tp.render(rep, console))

    def serve(self, o: ServeArgs) -> int:
        from pdcheck.trtllm.serve import command

        return command(o.scenario, o.releases, o.overrides, o.port, o.duration, o.json_out)

    # ------------------------------------------------------------------------------------------- doctor
    def doctor_checks(self, env: Mapping[str, str], context: Any) -> list[Any]:
        from pdcheck.trtllm.doctor import checks

        return checks(env, context)


FRAMEWORK = TensorRTLLM()
