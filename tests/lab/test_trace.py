"""Reading Mooncake-format traces: order, keys, and bad lines named."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokvo.errors import TraceFormatError
from aiokvo.lab.trace import parse_trace, read_trace
from tests.lab._traces import write_trace


def test_requests_are_in_timestamp_order_ties_in_file_order() -> None:
    trace = parse_trace([
        '{"timestamp": 20, "hash_ids": [1, 2]}',
        '',
        '{"timestamp": 10, "hash_ids": [1]}',
        '{"timestamp": 20, "hash_ids": [3]}',
        '{"timestamp": 10.5, "input_length": 1, "output_length": 2, "hash_ids": []}',
    ])  # fmt: skip
    assert trace.requests == ((1,), (), (1, 2), (3,))
    assert trace.timestamps == (10.0, 10.5, 20.0, 20.0)
    assert (len(trace), trace.references, trace.distinct_blocks) == (4, 4, 3)


def test_equal_ids_share_one_key_and_strings_are_ids_too() -> None:
    trace = parse_trace(['{"hash_ids": [7, "a", 7]}', '{"hash_ids": ["7", 7]}'])
    first, second = trace.keys
    assert first[0] is first[2] is second[1]
    assert len({first[0], first[1], second[0]}) == 3  # 7, "a" and "7" differ


def test_read_trace_reads_a_file(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 2]])
    trace = read_trace(path)
    assert trace.requests == ((0, 1), (0, 2))


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{nope", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 1}', "'hash_ids' must be a list"),
        ('{"hash_ids": [1, 2.5]}', "2.5"),
        ('{"hash_ids": [true]}', "True"),
        ('{"hash_ids": [-1]}', "-1"),
        ('{"hash_ids": [1], "timestamp": "soon"}', "'soon'"),
    ],
)
def test_a_bad_line_is_a_trace_format_error_naming_it(line: str, says: str) -> None:
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2") as caught:
        parse_trace(['{"hash_ids": [1]}', line], source="t.jsonl")
    assert says in str(caught.value)
