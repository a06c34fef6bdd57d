"""Packed columns are stored in the narrowest integer type that holds them and read back exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvscope.telemetry.packed import COLUMN_DTYPES, NULL_INT, narrow, widen

INT64 = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)


@given(st.sampled_from([n for n in COLUMN_DTYPES if n != "t_mono"]), st.lists(INT64, max_size=40),
       st.sampled_from([1, 100, 40_000, 3_000_000_000, 2**63 - 1]))
def test_integer_columns_round_trip_in_the_narrowest_type(name: str, values: list[int], bound: int) -> None:
    column = np.array([v % bound - bound // 2 for v in values], np.int64)
    stored, data = narrow(name, column)
    assert np.array_equal(widen(name, stored, data), column.astype(COLUMN_DTYPES[name]))
    fits = [t for t in ("<i1", "<i2", "<i4", "<i8")
            if not len(column) or (np.iinfo(t).min <= column.min() and column.max() <= np.iinfo(t).max)]
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
