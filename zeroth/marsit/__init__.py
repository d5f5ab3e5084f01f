"""Marsit (seed 004) as an experiment: one-bit multi-hop all-reduce over M workers, run by ``zeroth run``.

The algorithms (bit-wise sign merge, global compensation, the full-precision round every K, the
sign baselines, ring and 2D-torus all-reduce) live below, in :mod:`zeroth.collectives`; this
system adds what an experiment needs on top of them: data, models, a config with a list of runs
(:mod:`zeroth.marsit.config`), the CPU devices that stand for the workers
(:mod:`zeroth.marsit.devices`), the runner that writes a run folder (:mod:`zeroth.marsit.experiment`)
and the tables next to the seed's numbers (:mod:`zeroth.marsit.report`).

Example::

    zeroth run experiments/marsit_fig3b.yaml --out runs/marsit_fig3b --set train.rounds=50
    python -m zeroth.marsit.report runs/marsit_fig3b
"""

from zeroth.marsit.config import (
    RunSpec,
    is_config,
    load_runs,
    load_runs_dict,
    parse_overrides,
)
from zeroth.marsit.devices import DeviceError, ensure_cpu_devices
from zeroth.marsit.experiment import Stopped, run_config, run_one, table

__all__ = [
    "RunSpec",
    "is_config",
    "load_runs",
    "load_runs_dict",
    "parse_overrides",
    "DeviceError",
    "ensure_cpu_devices",
    "Stopped",
    "run_config",
    "run_one",
    "table",
]
