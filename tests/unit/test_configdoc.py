"""docs/configuration.md is what ``python -m router.configdoc`` prints."""

from pathlib import Path

from router.configdoc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_reference_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: run `python -m router.configdoc > docs/configuration.md`")
