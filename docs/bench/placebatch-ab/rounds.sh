#!/bin/bash
# Alternate `hlb bench latency --devices 1000 --pending 200 --json` between two checkouts of hlb
# (each run with its checkout first on PYTHONPATH, the same .venv), GNN then hetero-greedy, before
# then after, for ROUNDS rounds; one JSON line per run on stdout, as in rounds.jsonl here:
#
#   bash docs/bench/placebatch-ab/rounds.sh /path/to/before /path/to/after 8 SET >> rounds.jsonl
#
# Arguments after SET go to every run (journal-rounds.jsonl: `... 8 1 --journal`).
set -euo pipefail
before=$1 after=$2 rounds=$3 set_no=${4:-1}
shift $(($# < 4 ? $# : 4))
python=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python
for round in $(seq "$rounds"); do
  for policy in gnn hetero-greedy; do
    for code in before after; do
      dir=$before
      [ "$code" = after ] && dir=$after
      (cd "$dir" && PYTHONPATH=$dir:$dir/proto "$python" -m daemon.cli bench latency --policy "$policy" \
        --devices 1000 --pending 200 "$@" --json 2>/dev/null) |
        "$python" -c "import json, sys
d = json.load(sys.stdin)
print(json.dumps({'set': $set_no, 'round': $round, 'code': '$code', 'policy': '$policy', 'journal': d['journal'],
    'placements_per_s': d['place_batch']['placements_per_s'],
    'placements_per_floor_rpc': d['place_batch']['placements_per_floor_rpc'],
    'place_p50_over_floor': d['place']['p50_over_floor'], 'place_p99_over_floor': d['place']['p99_over_floor'],
    'floor_p50_us': d['floor']['p50_us'], 'floor_p99_us': d['floor']['p99_us']}))"
    done
  done
done
