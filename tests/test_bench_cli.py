"""`tandem bench` on a tiny random model: every configuration measured on both sides, the
ratios, the PNG chart, the assistant rows skipped (or run) and one-line flag errors."""

import json
from pathlib import Path

import pytest

from mlx_tandem.cli import bench as bench_cli
from mlx_tandem.cli.main import main
from mlx_tandem.lab.distill import DistillOptions, new_assistant
from mlx_tandem.models.assistant import save_assistant
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

QUICK = {
    "plain B=1, plain path", "plain B=1, rows engine", "batched B=4", "self-draft B=1",
    "ngram copy B=1", "ngram chat B=1", "assistant chat B=1",
    "ngram copy B=4", "ngram chat B=4", "assistant chat B=4",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("bench") / "tiny-bench")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty TANDEM_HOME (no trained assistants), and a scratch working folder."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def bench(capsys, folder: Path, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "--model", str(folder), "--quick", "--tokens", "8", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_quick_json_and_chart(capsys, tiny_folder, home, tmp_path):
    chart = tmp_path / "c.png"
    code, out, _ = bench(capsys, tiny_folder, "--json", "--chart", str(chart))
    assert code == 0
    results = json.loads(out)
    assert results["settings"]["tokens"] == 8 and results["chart"] == str(chart)
    rows = {r["name"]: r for r in results["configurations"]}
    assert set(rows) == QUICK
    for name, r in rows.items():
        if name.startswith("assistant"):
            assert r["skipped"] and "no assistant drafter" in r["note"]
            assert r["mlx_lm_tps"] is None and r["tandem_tps"] is None and r["ratio"] is None
            continue
        assert not r["skipped"], name
        assert r["mlx_lm_tps"] > 0 and r["tandem_tps"] > 0, name
        assert r["ratio"] == pytest.approx(r["tandem_tps"] / r["mlx_lm_tps"]), name
    assert rows["self-draft B=1"]["acceptance"] == 1.0  # the model drafting for itself
    assert rows["self-draft B=1"]["mlx_lm"].startswith("stream_generate(draft_model=self")
    assert rows["batched B=4"]["mlx_lm"] == "batch_generate"
    # rows sharing mlx-lm's B=1 chat run report the same measurement
    assert rows["plain B=1, plain path"]["mlx_lm_tps"] == rows["ngram chat B=1"]["mlx_lm_tps"]
    data = chart.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_assistant_rows_run_when_the_target_has_one(capsys, tiny_folder, home, monkeypatch):
    """(Without matplotlib, the plain install's case: no chart by default, and a note.)"""
    target = load_folder(tiny_folder, name=tiny_folder.name)
    opts = DistillOptions(layers=1, width=32, intermediate=64, vocab=64)
    save_assistant(new_assistant(target, opts, list(range(64))),
                   home / "assistants" / tiny_folder.name)
    real = bench_cli.find_spec
    monkeypatch.setattr(bench_cli, "find_spec", lambda n: None if n == "matplotlib" else real(n))
    code, out, err = bench(capsys, tiny_folder, "--chart", "c.png")
    assert code == 2 and "--chart needs matplotlib" in err
    code, out, _ = bench(capsys, tiny_folder)
    assert code == 0
    assert "skipped" not in out and "\nchart:" not in out and "no chart: pip install" in out
    assert not Path("tandem-bench.png").exists()
    table = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    for name in ("assistant chat B=1", "assistant chat B=4"):
        cells = table[name].split()
        assert cells[-3].endswith("x") and float(cells[-3][:-1]) > 0, table[name]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_flag_values_are_one_line_errors(capsys, tiny_folder, home, argv, needle):
    code = main(["bench", "--model", str(tiny_folder), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err and not out
