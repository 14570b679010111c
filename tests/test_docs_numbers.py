"""docs/numbers.py: the docs' quoted command output is regenerated from the commands themselves."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_numbers", ROOT / "docs" / "numbers.py")
numbers = importlib.util.module_from_spec(spec)
sys.modules["docs_numbers"] = numbers  # dataclasses look their module up there
spec.loader.exec_module(numbers)


def test_a_marked_block_gets_its_commands_output_and_the_rest_is_untouched(tmp_path):
    py = sys.executable
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n"
        f'<!-- numbers: keep="^(a|b) " setup="{py} -c \'open(\\"f\\", \\"w\\").write(\\"7\\")\'" -->\n'
        "```\n"
        f"$ {py} -c \"print('a', open('f').read()); print('noise'); print('b', 2 * 3)\"\n"
        "a 1\n"
        "stale line\n"
        f"$ {py} -c \"import sys; print('a', 'err', file=sys.stderr); sys.exit(2)\"\n"
        "old\n"
        "```\n\n"
        "```\n$ echo untouched\nkept as written\n```\n")
    assert numbers.rewrite(page, cwd=tmp_path) == 1
    text = page.read_text()
    body = text.split("```\n")[1].splitlines()
    # the setup's file is seen by the block's command; stderr and exit 2 are quoted like stdout
    assert [line for line in body if not line.startswith("$ ")] == ["a 7", "b 6", "a err"]
    assert body[0].startswith("$ ") and body[3].startswith("$ ") and len(body) == 5
    assert "stale line" not in text and "\nnoise" not in text and "\nold\n" not in text
    assert "$ echo untouched\nkept as written\n" in text
    assert text.startswith("Intro.\n\n<!-- numbers: keep=\"^(a|b) \" setup=")
    # a second pass is a fixed point: the marker survives its own rewrite
    numbers.rewrite(page, cwd=tmp_path)
    assert page.read_text() == text


def test_every_marked_block_of_the_docs_parses_and_names_a_dxrun_command():
    marked = [(path, b) for path in numbers.default_files()
              for b in numbers.blocks(path.read_text())]
    assert len(marked) >= 5
    for path, block in marked:
        assert all(c.startswith("python -m dxrun") for c in block.commands), path


def test_a_marker_with_an_unknown_option_is_one_clear_line():
    with pytest.raises(SystemExit, match="unknown marker option 'grep=x'.*keep="):
        numbers.blocks('<!-- numbers: grep=x -->\n```\n$ true\n```\n')


def test_log_lines_are_quoted_without_hydras_prefix_and_paths_relative(tmp_path):
    line = f"[2026-01-01 12:00:00,000][dxrun][WARNING] - step 5/10  in {tmp_path}/run"
    assert numbers.run(f"echo '{line}'; echo '[x] kept'", tmp_path, None) == [
        "step 5/10  in run", "[x] kept"]
