"""Zigzag context parallelism: index math (`zigzag`), verl's formulas (`verl`), `shard_batch`."""
