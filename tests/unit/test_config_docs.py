"""docs/operations.md carries the configuration table generated from the config tree."""

from pathlib import Path

import pytest

from kvstore.core.config import describe_options
from tools import gen_config_docs as gen

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_every_option_is_in_the_table_with_a_description():
    table = gen.render_table()
    helps = gen.option_help()
    for key, env, _typ, _default in describe_options():
        assert f"`{key}`" in table and f"`{env}`" in table
        assert helps[key], f"{key} has no description: add it to tools/gen_config_docs.HELP"
    assert set(gen.HELP) <= set(helps), "HELP names options that no longer exist"


def test_operations_doc_has_the_current_table():
    assert DOC.exists(), "docs/operations.md is missing"
    assert gen.render_table() in DOC.read_text(), \
        "docs/operations.md is stale: run python -m tools.gen_config_docs --write"


def test_splice_and_check(tmp_path):
    doc = tmp_path / "ops.md"
    doc.write_text(f"# Ops\n\n{gen.BEGIN}\nold\n{gen.END}\n\nafter\n")
    assert gen.main(["--check", "--doc", str(doc)]) == 1
    assert gen.main(["--write", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "\nold\n" not in text and text.endswith("\n\nafter\n") and gen.render_table() in text
    assert gen.main(["--check", "--doc", str(doc)]) == 0
    with pytest.raises(ValueError):
        gen.splice("no markers", "t")
