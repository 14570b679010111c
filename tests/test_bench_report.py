"""BENCHMARKS.md's generated sections (dxrun/bench/report.py), on a file in tmp_path."""

from __future__ import annotations

from dxrun.bench.report import markers, replace_section


def test_a_new_section_goes_before_the_first_heading_or_section_and_then_stays(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    pub = "\n".join((markers("published")[0], "## Plan mode", markers("published")[1]))
    md.write_text(f"# Benchmarks\n\nintro\n\n{pub}\n\n## Notes\n")
    replace_section(md, "torch", "\n".join((*markers("torch"), "")))
    text = md.read_text()
    assert text.index(markers("torch")[1]) < text.index(markers("published")[0])
    assert pub in text  # never split between its begin marker and its heading
    moved = text.replace("\n".join((*markers("torch"), "")) + "\n\n", "") + "\n".join(
        (markers("torch")[0], "old", markers("torch")[1])) + "\n"
    md.write_text(moved)  # a section someone moved keeps its place when rewritten
    replace_section(md, "torch", "\n".join((markers("torch")[0], "new", markers("torch")[1])))
    assert md.read_text() == moved.replace("old", "new")
