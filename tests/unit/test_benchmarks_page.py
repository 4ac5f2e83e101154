"""docs/benchmarks.md's tables are generated from docs/data (`quartctl report benchmarks`, issue 42 point 7): the
page in the repository is what the command writes, so a figure edited by hand (or a JSON changed without the
page) fails here."""

from __future__ import annotations

import json

import pytest
from quart_tools import report_benchmarks as rb


def test_the_page_is_what_its_data_generates(capsys) -> None:
    code = rb.main(["--check"])
    assert code == 0, "docs/benchmarks.md differs from docs/data; run `quartctl report benchmarks`:\n" + \
        capsys.readouterr().out[-4000:]


def test_a_figure_edited_by_hand_fails_the_check(tmp_path, capsys) -> None:
    page = rb.PAGE.read_text()
    block = rb._BLOCK.search(page)  # noqa: SLF001 - the module's own pattern
    assert block is not None and "76,219" in page
    edited = page.replace("| 1 | 76,219 |", "| 1 | 76,220 |", 1)
    assert edited != page
    copy = tmp_path / "benchmarks.md"
    copy.write_text(edited)
    assert rb.main(["--check", "--page", str(copy)]) == 1
    assert "-| 1 | 76,220 |" in capsys.readouterr().out
    assert rb.main(["--page", str(copy)]) == 0 and copy.read_text() == page  # rewritten from the data


def test_a_row_without_its_json_is_listed_as_not_reproducible(tmp_path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"x": 1.23456}))
    table = rb.Table("t", ["run", "x"], lambda runs: [rb.fixed(runs[0]["x"], 2)],
                     [rb.Row("1", ("a.json",)), rb.Row("2", ("gone.json",)), rb.Row("3", missing="overwritten")])
    page = "intro\n<!-- generated: t (quartctl report benchmarks) -->\nhand typed\n<!-- end generated -->\nprose\n"
    out = rb.generate(page, [table], tmp_path)
    assert "| 1 | 1.23 |" in out and "hand typed" not in out and out.startswith("intro\n") and out.endswith("prose\n")
    assert "| 2 |" not in out and "2: gone.json not in docs/data" in out and "3: overwritten" in out


def test_blocks_and_tables_match_one_to_one(tmp_path) -> None:
    table = rb.Table("t", ["run"], lambda runs: [], [])
    with pytest.raises(ValueError, match="no generated block"):
        rb.generate("no blocks\n", [table], tmp_path)
    with pytest.raises(ValueError, match="that no table"):
        rb.generate("<!-- generated: u (quartctl report benchmarks) -->\n<!-- end generated -->\n", [table], tmp_path)


def test_every_table_of_the_page_is_generated() -> None:
    """No table typed by hand: each one sits in a generated block (its figures come from docs/data)."""
    page = rb.PAGE.read_text()
    outside = rb._BLOCK.sub("", page)  # noqa: SLF001 - the module's own pattern
    typed = [line for line in outside.splitlines() if line.startswith("|")]
    assert not typed, f"tables typed by hand in docs/benchmarks.md (give them a Table in {rb.__name__}): {typed[:3]}"
