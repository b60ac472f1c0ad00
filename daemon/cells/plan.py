"""``hlb cells``: where cells land among the partitions of several instances (``hlb.daemon.cells.host``).

``hlb cells plan --partitions N CELL...`` prints, for each cell, the partition librdkafka's
default partitioner gives its key (CRC-32 of the cell name mod N), and names the cells that
would share a partition: with ``cells.enabled`` a partition carries one cell, so such a pair
needs more partitions or another name. Exit code 1 when any collide.
"""

from __future__ import annotations

import argparse
import json
import zlib

MAX_PARTITIONS = 4096


def shard_of(cell: str, partitions: int) -> int:
    """The partition of key ``cell`` under librdkafka's default partitioner (CRC-32 of the key)."""
    return zlib.crc32(cell.encode()) % partitions


def plan(cells: list[str], partitions: int) -> dict[int, list[str]]:
    """Partition -> the cells that land on it (only partitions some cell lands on)."""
    landing: dict[int, list[str]] = {}
    for cell in dict.fromkeys(cells):
        landing.setdefault(shard_of(cell, partitions), []).append(cell)
    return dict(sorted(landing.items()))


def smallest_without_collisions(cells: list[str], start: int) -> int | None:
    """The fewest partitions, at least ``start``, on which no two ``cells`` share one."""
    for partitions in range(max(start, 1), MAX_PARTITIONS + 1):
        if all(len(group) == 1 for group in plan(cells, partitions).values()):
            return partitions
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Show which partition each cell lands on with several instances (cells.enabled)."
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    planning = sub.add_parser("plan", help="partitions of cells, and the cells that would share one")
    planning.add_argument("--partitions", type=int, required=True, help="cells.partitions")
    planning.add_argument("cells", nargs="+", metavar="CELL", help="cell names")
    planning.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.partitions <= MAX_PARTITIONS:
        print(f"hlb cells: --partitions must be 1..{MAX_PARTITIONS}, got {args.partitions}")
        return 2
    landing = plan(args.cells, args.partitions)
    shared = {p: cells for p, cells in landing.items() if len(cells) > 1}
    fewest = smallest_without_collisions(args.cells, args.partitions) if shared else args.partitions
    if args.json:
        report = {"partitions": args.partitions, "landing": landing, "shared": shared, "fewest_without_sharing": fewest}
        print(json.dumps(report, indent=2))
    else:
        for partition, cells in landing.items():
            mark = "  <- shared: one cell only: the first seen" if len(cells) > 1 else ""
            print(f"partition {partition:>4}: {', '.join(cells)}{mark}")
        if shared:
            print(f"{len(shared)} partition(s) shared; no cell shares one with cells.partitions >= {fewest}")
    return 1 if shared else 0
