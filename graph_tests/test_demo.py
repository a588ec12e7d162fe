"""`layout-prop demo`: the main job on the built-in Llama block, with no files needed."""

from layout_prop.cli import main


def test_demo_runs_writes_its_page_and_matches_one_device(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    page = tmp_path / "layout-prop-demo.html"
    assert page.is_file() and "l0_attn" in page.read_text()
    assert str(page) in out
    assert "9 layout violations" in out and "reduce-scatter(tp)" in out and "all-gather(sp)" in out
    assert out.rstrip().endswith("matches one device")
