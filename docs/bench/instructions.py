"""Instructions per ``PlaceBatch`` placement (or per ``Place``), counted by valgrind's callgrind.

Time on a shared 2-core VM moves by a fifth from one minute to the next, so a change of a few
percent in the batch path cannot be shown by ``hlb bench latency`` without many alternating runs.
The number of instructions the deciding thread executes barely moves (0.4% between two runs of the
same code): this script counts them, in process (no gRPC), for the decisions alone.

It builds the cluster of ``hlb bench latency`` (``hlb.bench.latency.build_scheduler``: 1,000
shared devices, 200 queued tasks that do not fit; the GNN as the daemon runs it, with its
background refresh), makes ``--singles`` ``Place`` decisions, then counts the instructions of
``--batches`` batches of 1,000 one-device tasks, and prints JSON. Counting is switched on and off
around the batches by callgrind's client requests, through a two-function C shim compiled here with
the system's C compiler against valgrind's header; only the calling thread is counted (the
background refresh runs on its own thread). Under valgrind a run is about 50 times slower: about
20 s with the defaults. Needs ``valgrind`` (with its headers) and ``cc``:

    .venv/bin/python docs/bench/instructions.py --policy gnn
    .venv/bin/python docs/bench/instructions.py --policy hetero-greedy

``--count place`` counts ``--places`` single ``Place`` decisions instead of the batches (after the
same ``--singles``, uncounted):

    .venv/bin/python docs/bench/instructions.py --policy gnn --count place

``--keep DIR`` keeps the dump (``DIR/callgrind.<policy>.out``); ``callgrind_annotate --inclusive=yes``
on it gives the C functions' shares (the Python functions all run inside the interpreter's loop).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

SHIM = r"""
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void count_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT("batches"); CALLGRIND_STOP_INSTRUMENTATION; }
"""
BATCH = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="gnn", help="placement policy (default: %(default)s)")
    parser.add_argument("--singles", type=int, default=200, help="Place decisions first (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=3, help="counted batches of 1,000 (default: %(default)s)")
    parser.add_argument(
        "--count", choices=("batch", "place"), default="batch", help="what is counted (default: %(default)s)"
    )
    parser.add_argument("--places", type=int, default=200, help="counted Place decisions (default: %(default)s)")
    parser.add_argument(
        "--keep", type=Path, help="copy callgrind's dump of the batches here (for callgrind_annotate --inclusive=yes)"
    )
    parser.add_argument("--shim", type=Path, help=argparse.SUPPRESS)  # set by the outer run for the inner one
    return parser.parse_args(argv)


def count(args: argparse.Namespace) -> dict[str, Any]:
    """Run this script again under callgrind and read the count of the batches from its dump."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"instructions.py: needs {tool} on PATH")
    with tempfile.TemporaryDirectory(prefix="hlb-instructions-") as folder:
        shim = Path(folder) / "libcount.so"
        source = Path(folder) / "count.c"
        source.write_text(SHIM)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)], check=True)
        command = [sys.executable, __file__, "--policy", args.policy, "--singles", str(args.singles)]
        command += ["--batches", str(args.batches), "--count", args.count, "--places", str(args.places)]
        command += ["--shim", str(shim)]
        callgrind = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--instr-atstart=no"]
        callgrind += ["--separate-threads=yes", f"--callgrind-out-file={folder}/out.%p"]
        done = subprocess.run(callgrind + command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"instructions.py: the counted run failed:\n{done.stderr[-4000:]}")
        dumps = [p for p in Path(folder).glob("out.*") if "Client Request: batches" in p.read_text(errors="replace")]
        if len(dumps) != 1:
            raise SystemExit(f"instructions.py: expected one dump of the batches, found {len(dumps)}")
        found = re.search(r"^summary: (\d+)$", dumps[0].read_text(), re.MULTILINE)
        if found is None:
            raise SystemExit("instructions.py: no summary line in the dump")
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(dumps[0], args.keep / f"callgrind.{args.policy}.out")
    instructions = int(found.group(1))
    placements = args.batches * BATCH if args.count == "batch" else args.places
    return {
        "benchmark": "instructions",
        "policy": args.policy,
        "devices": 1000,
        "counted": "PlaceBatch" if args.count == "batch" else "Place",
        "singles": args.singles,
        "placements": placements,
        "instructions": instructions,
        "per_placement": round(instructions / placements),
    }


def inner(args: argparse.Namespace) -> None:
    """Under callgrind: the decisions, with counting on around the batches only."""
    from hlb.bench import latency as bench

    shim = ctypes.CDLL(str(args.shim))
    with bench.model_folder(None) as (folder, _):
        fallbacks: list[str] = []
        policy: Any = bench.gnn_policy(folder, fallbacks) if args.policy == "gnn" else args.policy
        scheduler = bench.build_scheduler(1000, 200, policy)
        lock = threading.RLock()
        if hasattr(policy, "start"):
            policy.start(scheduler.graph, lock)
        task = bench.task_maker()
        for _ in range(args.singles):
            with lock:
                scheduler.place(task("real"))
        decisions = []
        if args.count == "batch":
            batches = [[task("batch") for _ in range(BATCH)] for _ in range(args.batches)]
            shim.count_start()
            for specs in batches:
                with lock:
                    decisions.extend(scheduler.place_batch(specs))
            shim.count_stop()
        else:
            singles = [task("real") for _ in range(args.places)]
            shim.count_start()
            for spec in singles:
                with lock:
                    decisions.append(scheduler.place(spec))
            shim.count_stop()
        placed = sum(d.placement is not None for d in decisions)
        if hasattr(policy, "stop"):
            policy.stop()
        expected = args.batches * BATCH if args.count == "batch" else args.places
        if placed != expected or fallbacks:
            raise SystemExit(f"placed {placed} of {expected}, {len(fallbacks)} fallback decisions")


def main() -> None:
    args = parse_args()
    if args.shim is not None:
        inner(args)
    else:
        print(json.dumps(count(args)))


if __name__ == "__main__":
    main()
