"""Runner-level tests give each sequence a fixed run of KV blocks (a "slot"), as the scheduler would hand out."""


def slot(runner, index: int) -> list[int]:
    """Block table of sequence `index`: blocks enough for max_len (the runner's default pool holds num_slots)."""
    per_sequence = -(-runner.max_len // runner.cache.block_size)
    return list(range(index * per_sequence, (index + 1) * per_sequence))
