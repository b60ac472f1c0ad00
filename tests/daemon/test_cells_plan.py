"""``hlb cells plan``: where cells land, and which would share a partition."""

from __future__ import annotations

import zlib

from hlb.daemon.cells.plan import plan, shard_of, smallest_without_collisions


def test_a_cell_lands_on_its_crc32_modulo_the_partitions() -> None:
    assert shard_of("cell-00", 6) == zlib.crc32(b"cell-00") % 6
    assert all(0 <= shard_of(f"c{i}", 7) < 7 for i in range(100))


def test_plan_names_the_cells_that_share_a_partition() -> None:
    cells = ["a", "b", "c", "d"]
    landing = plan(cells, 6)
    assert sorted(c for group in landing.values() for c in group) == cells
    assert landing[shard_of("a", 6)] == [c for c in cells if shard_of(c, 6) == shard_of("a", 6)]
    assert any(len(group) > 1 for group in landing.values())  # a and c collide on 6 partitions


def test_the_fewest_partitions_without_sharing_has_no_collision() -> None:
    cells = [f"cell-{i:02d}" for i in range(12)]
    fewest = smallest_without_collisions(cells, len(cells))
    assert fewest is not None
    assert fewest >= len(cells)
    assert all(len(group) == 1 for group in plan(cells, fewest).values())
    assert any(len(group) > 1 for group in plan(cells, fewest - 1).values()) or fewest == len(cells)
