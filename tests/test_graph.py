import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_tandem.models.graph import bind_graph

from conftest import TINY_ARCHS


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_split_forward_is_bit_identical(tiny_model, arch):
    m = tiny_model(arch)
    ids = mx.array([[5, 17, 99, 3, 250, 42, 42, 7]])
    reference = m.model(ids)
    hidden = m.graph.forward_hidden(ids, None)
    assert mx.array_equal(m.graph.project_logits(hidden, "all"), reference).item()
    # Projecting fewer rows may change the BLAS kernel (shape-dependent summation
    # order under OpenBLAS), so selected rows are equal to rounding, not bitwise.
    last = m.graph.project_logits(hidden, "last")
    assert last.shape == (1, 1, reference.shape[-1])
    assert mx.allclose(last, reference[:, -1:], atol=1e-5).item()
    picks = m.graph.project_logits(hidden, mx.array([[0, 5]]))
    assert mx.allclose(picks, reference[:, [0, 5]], atol=1e-5).item()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cached_steps_match_model_call(tiny_model, arch):
    m = tiny_model(arch)
    ids = [5, 17, 99, 3, 250, 42, 42, 7]
    ours, theirs = m.graph.make_cache(), make_prompt_cache(m.model)
    for i in range(len(ids)):
        x = mx.array([ids[i : i + 1]])
        a = m.graph.project_logits(m.graph.forward_hidden(x, ours), "last")
        b = m.model(x, cache=theirs)
        assert mx.array_equal(a, b).item()


def test_bad_which_and_bad_model(tiny_model):
    m = tiny_model("llama")
    hidden = m.graph.forward_hidden(mx.array([[1, 2]]), None)
    with pytest.raises(ValueError, match="which"):
        m.graph.project_logits(hidden, "middle")
    with pytest.raises(ValueError, match="backbone"):
        bind_graph(mx)  # not a model
