"""Slow motion for the request-path tests on a loaded machine (docs/performance.md, "The test suite").

A request run's lease, arrival gaps and fault delays are absolute lengths, while a handshake or a rank's turn on
a core takes longer the more the machine does: beside a second copy of the suite (load average 15-37 on 2 cores)
a 1 s lease expired a line's first request during its first handshake. `pdcheck requests --time-scale` (and
$PDCHECK_TIME_SCALE) runs every length K times slower with the same verdicts, as the model runs on the same
lengths; the tests take K from the load as smoke's scheduler takes its rank budget (pdcheck.smoke), so an idle
machine runs them as written. A PDCHECK_TIME_SCALE set before the session is kept for every test (to run the
whole suite in slow motion)."""

from __future__ import annotations

import math
import os
from typing import Any

from pdcheck.smoke import LOADED_PER_CORE, _cores
from pdcheck.vllm.requests.plan import TIME_SCALE_ENV

FORCED = os.environ.get(TIME_SCALE_ENV)
MAX_SCALE = 4.0  # load 25 on 2 cores: a rank gets a twelfth of a core; 4x leaves the first handshake room


def time_scale() -> float:
    """1 on a machine within LOADED_PER_CORE per core; above, the 1-minute load average per 2 per core, in
    halves, at most MAX_SCALE."""
    if FORCED:
        return float(FORCED)
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    cores = _cores()
    if load <= LOADED_PER_CORE * cores:
        return 1.0
    return min(MAX_SCALE, math.ceil(load / (2 * cores) * 2) / 2)


def scaled(opts: Any) -> Any:
    """A test's own requests Options (run without the CLI's plan) at the slow motion its fixture chose."""
    return opts.scaled(float(os.environ.get(TIME_SCALE_ENV, "1")))
