"""Summary of repeated ``hlb bench latency --json`` runs of one code, read from their output.

The file holds the runs' JSON documents one after another (``hlb bench latency ... --json``
appended to it); runs are grouped by policy, device count and journal (false, or what an answer
waited for: ``write`` or ``fsync``; runs from before ``--journal-sync`` existed journaled with
fsync). Per group: the runs, how many met each target (``met`` in the JSON:
``Place`` p99 within the bound over the floor's p99, ``PlaceBatch`` at least 20,000 placements/s),
and the slowest, mean and fastest of ``PlaceBatch`` placements/s, of ``Place`` p99 over the
floor, and of ``Place`` p99 and the floor's p99 in microseconds (a background fsync slows the
floor calls too, so compare ``Place`` p99 with the floor of the runs without the journal as
well). The runs of 2026-12-05 (``runs.json`` beside this file) came from::

    for i in $(seq 10); do
      for policy in gnn hetero-greedy; do
        .venv/bin/hlb bench latency --policy $policy --devices 1000 --pending 200 --json
        .venv/bin/hlb bench latency --policy $policy --devices 1000 --pending 200 --journal --json
      done
      .venv/bin/hlb bench latency --policy gnn --devices 10000 --pending 200 --json
    done 2>/dev/null > docs/bench/series/runs.json
    .venv/bin/python docs/bench/series/summarize.py docs/bench/series/runs.json

(``--journal`` then meant fsync), and the later runs of that day (``runs-journal-sync.json``, journal sync modes) from::

    for i in $(seq 10); do
      .venv/bin/hlb bench latency --policy gnn --devices 1000 --pending 200 --json
      .venv/bin/hlb bench latency --policy gnn --devices 1000 --pending 200 --journal --journal-sync write --json
      .venv/bin/hlb bench latency --policy gnn --devices 1000 --pending 200 --journal --journal-sync fsync --json
      .venv/bin/hlb bench latency --policy hetero-greedy --devices 1000 --pending 200 --journal --json
      .venv/bin/hlb bench latency --policy gnn --devices 10000 --pending 200 --journal --json
    done 2>/dev/null > docs/bench/series/runs-journal-sync.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (policy, devices, journal), in the order the groups first appear."""
    groups: dict[tuple[str, int, str | bool], list[dict[str, Any]]] = {}
    for run in runs:
        journal = run.get("journal_sync") or ("fsync" if run["journal"] else False)
        groups.setdefault((run["policy"], run["devices"], journal), []).append(run)
    table = []
    for (policy, devices, journal), group in groups.items():
        rate = [r["place_batch"]["placements_per_s"] for r in group]
        ratio = [r["place"]["p99_over_floor"] for r in group]
        table.append(
            {
                "policy": policy,
                "devices": devices,
                "journal": journal,
                "runs": len(group),
                "place_p99_met": sum(r["met"]["place_p99"] for r in group),
                "place_batch_met": sum(r["met"]["place_batch"] for r in group),
                "placements_per_s": [round(min(rate)), round(sum(rate) / len(rate)), round(max(rate))],
                "place_p99_over_floor": [min(ratio), round(sum(ratio) / len(ratio), 2), max(ratio)],
                "place_p99_us": _spread([r["place"]["p99_us"] for r in group]),
                "floor_p99_us": _spread([r["floor"]["p99_us"] for r in group]),
                "floor_p50_us": [min(r["floor"]["p50_us"] for r in group), max(r["floor"]["p50_us"] for r in group)],
            }
        )
    return table


def _spread(values: list[float]) -> list[float]:
    """Lowest, mean and highest, to 0.1."""
    return [round(min(values), 1), round(sum(values) / len(values), 1), round(max(values), 1)]


def read_runs(text: str) -> list[dict[str, Any]]:
    """The JSON documents in ``text``, one after another (whitespace between them)."""
    decoder, at = json.JSONDecoder(), 0
    runs: list[dict[str, Any]] = []
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return runs
        run, at = decoder.raw_decode(text, at)
        runs.append(run)


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("runs.json"))
    runs = read_runs(path.read_text())
    for row in summarize(runs):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
