"""Convert Philly's job log (Pollux's ``philly.csv``) into an hlb trace file.

    python -m hlb.sim.philly_trace PHILLY_CSV OUT.csv [--seed 0] [--min-duration-s 60]

Every eligible row becomes one single-task job at its recorded submission time (s after the
earliest eligible submission); the rules are :func:`hlb.sim.workloads.philly_jobs`'s: rows of at
least ``--min-duration-s`` seconds (Pollux's filter) whose gang is a size the catalogue knows
(1, 2, 4, 8; the rare 12-128 GPU jobs are left out and counted), the workload class drawn
uniformly, with ``--seed``, among the classes that support the gang, and the Philly duration taken
as the gang's run time on V100s. The source row is kept in the label ``philly_row``. Philly's log
has no device models, so the trace names none: ``hlb eval`` places it on any inventory
(``docs/trace-replay.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.catalogue_sources import GANG_SIZES
from hlb.sim.traces import write_trace
from hlb.sim.workloads import PhillyTable, Task, load_philly_table, philly_jobs


def philly_trace(table: PhillyTable, catalogue: Catalogue, seed: int = 0, min_duration_s: float = 60.0) -> list[Task]:
    """Every eligible row of ``table`` as a task, in submission order (see the module docstring)."""
    eligible = int(np.count_nonzero((table.duration_s >= min_duration_s) & np.isin(table.num_gpus, GANG_SIZES)))
    if eligible == 0:
        raise ValueError("no eligible Philly rows")
    return philly_jobs(seed, eligible, catalogue, table, min_duration_s=min_duration_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlb.sim.philly_trace", description=__doc__.splitlines()[0])
    parser.add_argument("philly_csv", type=Path, help="Pollux's philly.csv (timestamp,duration,num_gpus,...)")
    parser.add_argument("out", type=Path, help="the trace file to write (.csv or .jsonl)")
    parser.add_argument("--seed", type=int, default=0, help="draws the workload classes (default: 0)")
    parser.add_argument("--min-duration-s", type=float, default=60.0, help="shorter rows are left out")
    args = parser.parse_args(argv)
    try:
        table = load_philly_table(args.philly_csv)
        tasks = philly_trace(table, load_catalogue(), args.seed, args.min_duration_s)
    except (OSError, ValueError) as error:
        print(f"python -m hlb.sim.philly_trace: {error}", file=sys.stderr)
        return 2
    write_trace(args.out, tasks)
    short = int(np.count_nonzero(table.duration_s < args.min_duration_s))
    other_gangs = int(
        np.count_nonzero((table.duration_s >= args.min_duration_s) & ~np.isin(table.num_gpus, GANG_SIZES))
    )
    print(
        f"wrote {args.out}: {len(tasks)} tasks of {len(table.duration_s)} rows "
        f"({short} shorter than {args.min_duration_s:g} s, {other_gangs} with a gang other than "
        f"{'/'.join(map(str, GANG_SIZES))} left out), over {tasks[-1].arrival_s / 86400.0:.1f} days"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
