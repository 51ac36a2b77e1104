"""RuntimeConfig: flags over TANDEM_* variables over defaults, every value checked before use."""

import pytest

from mlx_tandem.engine.config import RuntimeConfig, parse_bytes


def test_precedence_flag_over_environment_over_default():
    env = {"TANDEM_MAX_ROWS": "8", "TANDEM_PREFILL_STALL_MS": "250", "TANDEM_MEMORY_BUDGET": "2G"}
    cfg = RuntimeConfig.resolve(environ=env)
    assert (cfg.max_rows, cfg.prefill_stall_ms, cfg.memory_budget) == (8, 250, 2 << 30)
    assert RuntimeConfig.resolve(environ=env, max_rows=3).max_rows == 3
    assert RuntimeConfig.resolve(environ={}).max_rows == 16
    assert RuntimeConfig.resolve(environ={"TANDEM_BATCH_INVARIANT": "off"}).batch_invariant is False


def test_flags_and_variables_spell_booleans_alike():
    """One reading of a boolean for `--batch-invariant f` and TANDEM_BATCH_INVARIANT=f."""
    from mlx_tandem.cli.options import str2bool

    for word, value in (("t", True), ("F", False), ("yes", True), ("0", False), ("On", True)):
        assert str2bool(word) is value
        env = {"TANDEM_BATCH_INVARIANT": word}
        assert RuntimeConfig.resolve(environ=env).batch_invariant is value


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TANDEM_MAX_ROWS": "many"}, "TANDEM_MAX_ROWS='many' is not an integer"),
        ({"TANDEM_MAX_ROWS": "0"}, "max_rows must be >= 1"),
        ({"TANDEM_PREFILL_STALL_MS": "-1"}, "prefill_stall_ms must be >= 0"),
        ({"TANDEM_BATCH_INVARIANT": "maybe"}, "expected true/false \\(t/f\\), 1/0"),
        ({"TANDEM_MEMORY_BUDGET": "lots"}, "not a number of bytes"),
        ({"TANDEM_BUFFER_CACHE": "lots"}, "TANDEM_BUFFER_CACHE: memory size 'lots' is not"),
    ],
)
def test_bad_values_are_refused_naming_them(env, needle):
    with pytest.raises(ValueError, match=needle):
        RuntimeConfig.resolve(environ=env)


def test_parse_bytes():
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1.5k") == 1536
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes("0")


def test_an_engine_sets_mlx_buffer_cache_limit(tiny_model):
    """Given, the limit is set as given (0 included); auto on the CPU backend raises MLX's
    32 MiB default to min(1 GiB, a 16th of memory) and never lowers a higher limit."""
    import mlx.core as mx

    from mlx_tandem.engine.core import EngineCore
    from mlx_tandem.engine.scheduler import BUFFER_CACHE_MOST, _device_memory

    model = tiny_model("llama")
    before = mx.set_cache_limit(32 << 20)
    try:
        auto = min(BUFFER_CACHE_MOST, _device_memory() // 16)
        assert EngineCore(model, RuntimeConfig.resolve(environ={})).buffer_cache == auto
        assert mx.set_cache_limit(3 << 30) == auto
        assert EngineCore(model, RuntimeConfig.resolve(environ={})).buffer_cache == 3 << 30
        assert mx.set_cache_limit(32 << 20) == 3 << 30
        for given in (96 << 20, 0):
            env = {"TANDEM_BUFFER_CACHE": str(given)}
            assert EngineCore(model, RuntimeConfig.resolve(environ=env)).buffer_cache == given
            assert mx.set_cache_limit(32 << 20) == given
    finally:
        mx.set_cache_limit(before)
