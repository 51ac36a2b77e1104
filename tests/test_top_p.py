"""Top-p from the row's top candidates: the full sort's threshold, bit for bit."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

from mlx_tandem.engine.top_p import _threshold, top_p_filter

V = 5000  # wider than the candidates below, so both paths run
FEW = 256


def _rows(scale: float, seed: int, n: int = 6) -> mx.array:
    x = mx.random.normal((n, V), key=mx.random.key(seed)) * scale
    if scale > 2:  # ties: repeated values across the cut
        x = mx.round(x * 4) / 4
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("scale", [0.3, 3.0, 6.0])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_candidates_give_the_full_sorts_threshold(scale, top_p):
    lp = _rows(scale, seed=int(scale * 10))
    ours = top_p_filter(lp, top_p, candidates=FEW)
    full = top_p_filter(lp, top_p, candidates=V)
    assert mx.array_equal(ours, full).item()
    kept = mx.sum(ours > -mx.inf, axis=-1)
    assert mx.all(kept >= 1).item()
    # leading axes (a verify's slots) are rows too
    stacked = top_p_filter(lp.reshape(2, 3, V), top_p, candidates=FEW)
    assert mx.array_equal(stacked.reshape(6, V), ours).item()


def test_flat_rows_need_the_fallback():
    """Control: a flat row's nucleus is wider than its candidates; the candidates' own
    threshold (without the fallback) keeps all of them and nothing else — too few."""
    lp = _rows(0.3, seed=3)
    threshold, fits = _threshold(lp, 0.9, FEW)
    assert not mx.any(fits).item()
    alone = mx.sum(lp >= threshold, axis=-1)
    right = mx.sum(top_p_filter(lp, 0.9, candidates=FEW) > -mx.inf, axis=-1)
    assert mx.all(alone == FEW).item() and mx.all(right > 2 * FEW).item()


def test_peaked_rows_take_the_candidates_path():
    lp = _rows(6.0, seed=4)
    assert mx.all(_threshold(lp, 0.9, FEW)[1]).item()


@pytest.mark.parametrize("scale", [0.3, 3.0, 6.0])
def test_kept_sets_differ_from_mlx_lm_only_at_the_cut(scale):
    """mlx-lm sums the total in sorted order, this filter directly: the two thresholds
    differ by at most the tokens whose mass-above is within rounding of top_p."""
    lp = _rows(scale, seed=7)
    ours = np.array(top_p_filter(lp, 0.9, candidates=FEW) > -mx.inf)
    theirs = np.array(apply_top_p(lp, 0.9) > -mx.inf)
    probs = np.exp(np.array(lp, dtype=np.float64))
    for row in range(lp.shape[0]):
        differ = np.flatnonzero(ours[row] != theirs[row])
        above = np.array([probs[row][probs[row] > probs[row][t]].sum() for t in differ])
        assert np.all(np.abs(above - 0.9) < 1e-3), (row, differ)
