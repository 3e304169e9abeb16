"""pipeline/core/random_inputs.py: integer draws that keep the token each row ends with."""

import numpy as np

from trt_pipeline.pipeline.core.random_inputs import end_token, integer_range, random_inputs

EOS = 2


def _rows(*rows: list[int]) -> np.ndarray:
    return np.array(rows, dtype=np.int64)


def test_the_token_every_row_ends_with_and_nothing_else_holds_is_an_end_token():
    ended = _rows([5, 7, EOS], [9, 3, EOS])
    assert end_token([ended, _rows([4, 6, 8, 8, EOS])]) == EOS  # over cases of other lengths too
    assert integer_range([ended], EOS) == (3, 9)  # the range of the rest
    assert end_token([_rows([5, 7, EOS])]) is None  # one row cannot tell it from chance
    assert end_token([_rows([5, EOS, EOS], [9, 3, EOS])]) is None  # it occurs elsewhere: not an end
    assert end_token([_rows([5, 7, EOS], [9, 3, 4])]) is None  # rows end differently
    assert integer_range([ended], None) == (2, 9)


def test_draws_end_each_row_with_the_end_token_and_draw_the_rest_in_range():
    records = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}]
    feed = random_inputs(
        records, 4, 0, axis_sizes={"sequence": 6}, int_ranges={"input_ids": (3, 12)}, end_tokens={"input_ids": EOS}
    )["input_ids"]
    assert feed.shape == (4, 6) and (feed[:, -1] == EOS).all()
    assert feed[:, :-1].min() >= 3 and feed[:, :-1].max() <= 12
