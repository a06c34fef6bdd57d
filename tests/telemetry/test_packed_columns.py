"""Packed columns are stored in the narrowest integer type that holds them and read back exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvscope.telemetry.packed import BATCH, COLUMN_DTYPES, NULL_INT, Packer, narrow, widen

INT64 = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)


@given(
    st.sampled_from([n for n in COLUMN_DTYPES if n != "t_mono"]),
    st.lists(INT64, max_size=40),
    st.sampled_from([1, 100, 40_000, 3_000_000_000, 2**63 - 1]),
)
def test_integer_columns_round_trip_in_the_narrowest_type(name: str, values: list[int], bound: int) -> None:
    column = np.array([v % bound - bound // 2 for v in values], np.int64)
    stored, data = narrow(name, column)
    assert np.array_equal(widen(name, stored, data), column.astype(COLUMN_DTYPES[name]))
    fits = [
        t
        for t in ("<i1", "<i2", "<i4", "<i8")
        if not len(column) or (np.iinfo(t).min <= column.min() and column.max() <= np.iinfo(t).max)
    ]
    assert np.dtype(stored) == np.dtype(fits[0]) or (name == "node_id" and np.dtype(stored) in map(np.dtype, fits))


@given(st.lists(st.one_of(st.none(), INT64), max_size=40), st.sampled_from([100, 40_000, 2**40, 2**63 - 1]))
def test_node_ids_keep_their_nulls_and_every_id(values: list[int | None], bound: int) -> None:
    column = np.array([NULL_INT if v is None else v % bound for v in values], np.int64)
    if len(column):
        column[0] = -bound // 2 if values and values[0] is not None else column[0]  # the smallest ids too
    stored, data = narrow("node_id", column)
    assert np.array_equal(widen("node_id", stored, data), column)


def test_small_ids_with_nulls_take_one_byte_and_times_stay_float64() -> None:
    assert np.dtype(narrow("node_id", np.array([NULL_INT, 3, 127], np.int64))[0]) == np.int8
    assert np.dtype(narrow("node_id", np.array([-128, 3], np.int64))[0]) == np.int16  # NOTE: -128 is int8's NULL
    times = np.array([1.5, 2**40 + 0.25])
    stored, data = narrow("t_mono", times)
    assert stored == "<f8" and np.array_equal(widen("t_mono", stored, data), times)


ITEM = st.one_of(
    st.tuples(
        st.just("plain"),
        st.one_of(st.none(), st.integers(0, 50)),
        st.sampled_from(["r1", "r2", None]),
        st.lists(st.integers(0, 1000), max_size=4),
    ),
    st.tuples(st.just("batch"), st.lists(st.sampled_from(["r1", "r3", None]), max_size=4), st.integers(0, 3)),
)


@given(st.lists(ITEM, max_size=30))
def test_items_and_batch_items_unpack_into_their_events_in_order(items: list[tuple]) -> None:
    """Plain items and batch items (one per request, slots split by token counts) in any order
    become one event each per request, with their rid, node, token count and slots."""
    flat: list[object] = []
    expected = []
    for step, item in enumerate(items):
        if item[0] == "plain":
            _, node, rid, slots = item
            flat += [
                step,
                0.5,
                "alloc",
                "full",
                rid,
                node,
                len(slots),
                0,
                None,
                None,
                np.array(slots, np.int64).tobytes(),
            ]
            expected.append((step, rid, NULL_INT if node is None else node, len(slots), slots))
        else:
            _, rids, per = item
            slots = list(range(per * len(rids)))
            flat += [
                step,
                0.5,
                "free",
                "full",
                tuple(rids),
                BATCH,
                (per,) * len(rids),
                0,
                None,
                None,
                np.array(slots, np.int64).tobytes(),
            ]
            expected += [(step, r, NULL_INT, per, slots[i * per : (i + 1) * per]) for i, r in enumerate(rids)]
    packer = Packer()
    chunk = packer.pack(flat, has_batches=True)
    cols = {name: widen(name, *chunk.columns[name]) for name in chunk.columns}
    assert chunk.num_events == len(expected)
    texts = [None, *packer.codes.texts]
    counts = cols["slot_counts"]
    starts = np.concatenate(([0], np.cumsum(np.maximum(counts, 0))))
    got = [
        (
            int(cols["step"][i]),
            texts[cols["rid"][i] + 1],
            int(cols["node_id"][i]),
            int(cols["num_tokens"][i]),
            cols["slots"][starts[i] : starts[i + 1]].tolist(),
        )
        for i in range(chunk.num_events)
    ]
    assert got == expected
