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


# Defaults that `kvstore-server --help` states in words, not as a value of the field
# (each field's default is "": worked out at start-up, or off).
_HELP_IN_WORDS = {"te_host": "--host", "te_devices": "all it finds",
                  "nvme_path": "<data-dir>/nvme.slab", "cluster": "off", "node_id": "host:port"}
# Flags whose help states no default (keys: none, and none may be shown).
_NO_DEFAULT_SHOWN = {"curve_secret_key", "curve_authorized_keys"}


def test_the_server_help_states_each_flags_config_default():
    """Every ``[default]`` in kvstore-server's --help is the config's default of the
    field the flag sets (a help text that kept an old default misleads operators),
    and every flag that sets a config field states one."""
    import re

    from kvstore.core.config import KVStoreConfig, parse_size
    from kvstore.server.cli import _FLAGS, cli

    defaults = KVStoreConfig()
    checked = set()
    for param in cli.params:
        if param.name not in _FLAGS or param.name in _NO_DEFAULT_SHOWN:
            continue
        stated = re.search(r"\[([^\]]*)\]$", param.help or "")
        assert stated, f"--{param.name}: its help states no [default]"
        text = stated.group(1)
        section, field = _FLAGS[param.name]
        value = getattr(getattr(defaults, section), field)
        if param.name in _HELP_IN_WORDS:
            assert (text, value) == (_HELP_IN_WORDS[param.name], ""), param.name
        elif isinstance(value, bool):
            assert text == ("on" if value else "off"), (param.name, text, value)
        elif isinstance(value, (int, float)) and re.search(r"[KMGT]iB$", text):
            assert parse_size(text) == value, (param.name, text, value)
        elif isinstance(value, (int, float)):
            assert float(text) == value, (param.name, text, value)
        elif param.name == "data_dir":  # "./kvstore-data" is the relative path
            assert Path(text) == Path(value), (param.name, text, value)
        else:
            assert text == str(value), (param.name, text, value)
        checked.add(param.name)
    assert checked == set(_FLAGS) - _NO_DEFAULT_SHOWN
