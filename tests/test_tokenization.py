"""Padding and masking helpers, checked by hand."""

import numpy as np
import pytest

from jaxrlhf.data.arithmetic import score_answer
from jaxrlhf.tokenization import (
    concat_prompt_response,
    has_eos,
    left_pad,
    response_mask_after_eos,
    right_pad,
)


def test_left_and_right_pad():
    ids, mask = left_pad([[5, 6], [7, 8, 9]], pad_id=0)
    np.testing.assert_array_equal(ids, [[0, 5, 6], [7, 8, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [1, 1, 1]])
    ids, mask = right_pad([[5], [7, 8, 9]], pad_id=0, length=2)
    np.testing.assert_array_equal(ids, [[5, 0], [7, 8]])
    np.testing.assert_array_equal(mask, [[1, 0], [1, 1]])
    with pytest.raises(ValueError, match="3 tokens, more than the 2"):
        left_pad([[1, 2, 3]], 0, length=2)


def test_response_mask_stops_after_first_eos():
    responses = np.array([[4, 2, 9, 2], [4, 5, 6, 7], [2, 3, 3, 3]])
    np.testing.assert_array_equal(
        response_mask_after_eos(responses, [2]), [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    )
    np.testing.assert_array_equal(has_eos(responses, [2]), [True, False, True])


def test_concat_aligns_loss_mask_with_token_logprobs():
    p_ids, p_mask = left_pad([[11, 12]], 0, length=3)
    r_ids, r_mask = right_pad([[21, 2]], 0, length=3)
    ids, attn, loss = concat_prompt_response(p_ids, p_mask, r_ids, r_mask)
    np.testing.assert_array_equal(ids, [[0, 11, 12, 21, 2, 0]])
    np.testing.assert_array_equal(attn, [[0, 1, 1, 1, 1, 0]])
    # token_logprobs entry t scores ids[t+1]: the response tokens 21 and 2 are entries 2 and 3.
    np.testing.assert_array_equal(loss, [[0, 0, 1, 1, 0]])


def test_arithmetic_scores():
    assert score_answer("The answer is 46.", 46) == 1.0
    assert score_answer("12 + 34 = 47", 46) == 0.0
    assert score_answer("no number", 46) == 0.0
