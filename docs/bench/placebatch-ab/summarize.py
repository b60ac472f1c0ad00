"""The README's before/after tables over gRPC, from the runs in rounds.jsonl (or the file named).

Each round ran ``hlb bench latency --devices 1000 --pending 200 --json`` for the GNN and for
hetero-greedy, from a checkout of the code before the change and one after, in turn
(``rounds.sh`` beside this file). Per policy: mean and slowest placements/s, the per-round ratio
after / before with its 95% Student-t interval (``hlb.sim.eval.confidence_interval``), the runs at
least 20,000 placements/s, and ``Place`` p99 over the floor's p99 with the runs above 2 and
Fisher's exact test of that split, and the per-round ratios of ``Place`` p50 and p99 over the
floor, after / before:

    .venv/bin/python docs/bench/placebatch-ab/summarize.py
    .venv/bin/python docs/bench/placebatch-ab/summarize.py docs/bench/placebatch-ab/place-rounds.jsonl

The second file holds the rounds of the ``Place`` change of 2026-12-05 (group rows cached, the
ended tasks forgotten), 12 rounds run by ``rounds.sh BEFORE AFTER 12``; ``journal-rounds.jsonl``
those of the journal's appends (2026-12-05), 8 rounds with the journal on, run by
``rounds.sh BEFORE AFTER 8 1 --journal``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scipy import stats

from hlb.sim.eval import _percent, confidence_interval

TARGET = 20_000.0  # placements/s at 1,000 devices (docs/design.md §7)


def paired(before: list[float], after: list[float]) -> str:
    """Mean of after / before - 1 over the rounds with its 95% interval, in percent, as ``hlb eval`` writes it."""
    mean, half = confidence_interval([a / b - 1.0 for b, a in zip(before, after, strict=True)])
    return _percent({"mean": mean, "ci95": half})


def fisher_p(a: int, b: int, n: int) -> float:
    """Two-sided p-value of Fisher's exact test: ``a`` of ``n`` runs against ``b`` of ``n``."""
    return float(stats.fisher_exact([[a, n - a], [b, n - b]]).pvalue)


def _round(run: dict[str, Any]) -> tuple[int, int]:
    """What pairs a run before with one after: its set and round."""
    return run["set"], run["round"]


def compare(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, the figures of the README's table."""
    result = {}
    for policy in sorted({run["policy"] for run in runs}):
        before = sorted((r for r in runs if r["policy"] == policy and r["code"] == "before"), key=_round)
        after = sorted((r for r in runs if r["policy"] == policy and r["code"] == "after"), key=_round)
        if [_round(r) for r in before] != [_round(r) for r in after]:
            raise SystemExit(f"{policy}: the rounds before and after do not pair up")
        sides = (("before", before), ("after", after))
        rate = {name: [r["placements_per_s"] for r in side] for name, side in sides}
        ratio = {name: [r["place_p99_over_floor"] for r in side] for name, side in sides}
        per_floor = [r["placements_per_floor_rpc"] for r in before], [r["placements_per_floor_rpc"] for r in after]
        above = {name: sum(v > 2.0 for v in values) for name, values in ratio.items()}
        result[policy] = {
            "rounds": len(before),
            "placements_per_s": {name: {"mean": round(sum(v) / len(v)), "min": min(v)} for name, v in rate.items()},
            "after_over_before": paired(rate["before"], rate["after"]),
            "faster_rounds": sum(a > b for b, a in zip(rate["before"], rate["after"], strict=True)),
            "per_floor_rpc_after_over_before": paired(*per_floor),
            "runs_at_target": {name: sum(v >= TARGET for v in values) for name, values in rate.items()},
            "place_p99_over_floor": {name: round(sum(v) / len(v), 2) for name, v in ratio.items()},
            "runs_above_2": above,
            "runs_above_2_fisher_p": round(fisher_p(above["after"], above["before"], len(before)), 2),
            "place_p50_over_floor": {
                name: round(sum(r["place_p50_over_floor"] for r in side) / len(side), 2) for name, side in sides
            },
            "place_p50_over_floor_after_over_before": paired(
                [r["place_p50_over_floor"] for r in before], [r["place_p50_over_floor"] for r in after]
            ),
            "place_p99_over_floor_after_over_before": paired(ratio["before"], ratio["after"]),
        }
    return result


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("rounds.jsonl")
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(json.dumps(compare(runs), indent=1))


if __name__ == "__main__":
    main()
