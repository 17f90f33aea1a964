"""Small prefix-chain traces for the lab's tests, built as conversations are."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hypothesis import strategies as st


def conversation_trace(seed: int, requests: int, *, max_new: int = 4) -> list[list[int]]:
    """Requests that extend an earlier one (a next turn) or start afresh.

    Every id keeps one position and one predecessor, as in the Mooncake
    traces: a new request copies a random earlier request's first blocks
    and appends new ids.
    """
    rng = random.Random(seed)
    out: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        prefix: list[int] = []
        if out and rng.random() < 0.7:
            earlier = rng.choice(out)
            prefix = earlier[: rng.randint(1, len(earlier))]
        new = list(range(next_id, next_id + rng.randint(0 if prefix else 1, max_new)))
        next_id += len(new)
        out.append(prefix + new)
    return out


traces = st.builds(
    conversation_trace, st.integers(0, 10_000), st.integers(1, 40), max_new=st.integers(1, 5)
)


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    with path.open("w") as out:
        for i, ids in enumerate(requests):
            record = {"timestamp": i * 10, "input_length": 512 * len(ids),
                      "output_length": 8, "hash_ids": ids}  # fmt: skip
            out.write(json.dumps(record) + "\n")
    return path
