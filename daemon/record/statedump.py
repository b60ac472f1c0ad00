"""A canonical dump of the daemon's state, for comparing two daemons (or one before and after).

Rows, free lists and arrival counters depend on the order in which events were applied, so the
dump names everything by id: every live device, host, switch and link with all its columns
(references between tables as ids), every task with its state and, while it holds devices, the
devices it holds, the pending queue in order, and the ledger's size. Two daemons whose dumps are
equal make the same decisions from then on.

``hlb serve`` writes the dump on request: ``kill -USR1 <pid>`` writes
``<state_dir>/state-dump.json`` (atomically: write, fsync, rename), so a reader never sees half
a file. Ingest counters are added under ``"ingest"``; they are not part of the graph.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.tables import DEVICE_NODE, HOST_NODE, Table

DUMP_NAME = "state-dump.json"


def _columns(table: Table, row: int, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {name: getattr(table, name)[row].item() for name in table.COLUMNS if name not in skip}


def _id_of(table: Table, row: int) -> str | None:
    return table.ids[row] if row >= 0 else None


def canonical_state(scheduler: Scheduler) -> dict[str, Any]:
    """The scheduler's graph, queue and ledger size as plain data keyed by id; the caller holds the lock."""
    g = scheduler.graph
    devices = {}
    for row in g.devices.live_rows():
        r = int(row)
        entry = _columns(g.devices, r, skip=("model", "host"))
        entry["model"] = g.model_of(r)
        entry["host"] = _id_of(g.hosts, int(g.devices.host[r]))
        devices[g.devices.ids[r]] = entry
    hosts = {}
    for row in g.hosts.live_rows():
        r = int(row)
        entry = _columns(g.hosts, r, skip=("rack",))
        entry["rack"] = _id_of(g.switches, int(g.hosts.rack[r]))
        hosts[g.hosts.ids[r]] = entry
    switches = {}
    for row in g.switches.live_rows():
        r = int(row)
        entry = _columns(g.switches, r, skip=("parent",))
        entry["parent"] = _id_of(g.switches, int(g.switches.parent[r]))
        switches[g.switches.ids[r]] = entry
    tables = {DEVICE_NODE: g.devices, HOST_NODE: g.hosts}
    links = {}
    for row in g.links.live_rows():
        r = int(row)
        t = g.links
        entry = _columns(t, r, skip=("src", "dst"))
        entry["src"] = _id_of(tables.get(int(t.src_type[r]), g.switches), int(t.src[r]))
        entry["dst"] = _id_of(tables.get(int(t.dst_type[r]), g.switches), int(t.dst[r]))
        links[t.ids[r]] = entry
    tasks = {
        task_id: {
            "state": task.state.label,
            "devices": list(task.device_ids) if task.state.holds_devices else [],
        }
        for task_id, task in g.tasks.items()
    }
    return {
        "devices": dict(sorted(devices.items())),
        "hosts": dict(sorted(hosts.items())),
        "switches": dict(sorted(switches.items())),
        "links": dict(sorted(links.items())),
        "tasks": dict(sorted(tasks.items())),
        "queue": [task.spec.id for task in scheduler.queued()],
        "ledger": {"placements": len(scheduler.ledger), "last_sequence": scheduler.ledger.last_sequence},
        "newest_telemetry_ms": g.newest_telemetry_ms,
    }


def write_dump(state: dict[str, Any], state_dir: Path) -> Path:
    """Write ``state`` as JSON to ``state_dir/state-dump.json`` atomically; returns the path."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / DUMP_NAME
    partial = path.with_suffix(".json.partial")
    try:
        with partial.open("w") as out:
            json.dump(state, out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except OSError:  # a full disk: no half-written file left beside the last good dump
        partial.unlink(missing_ok=True)
        raise
    return path
