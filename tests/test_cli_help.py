"""`radixgen serve --help` explains itself: every option sits in a named group, options whose field
has a docstring carry its first sentence, and a None default is not shown as 'default: None'."""

from __future__ import annotations

import argparse
import dataclasses

from radixgen.cli import _GROUPS, add_config_flags, field_docs
from radixgen.config import ServerConfig


def test_every_option_is_grouped_and_documented_from_its_field() -> None:
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    grouped = {name for names in _GROUPS.values() for name in names}
    assert fields <= grouped, f"options in no group: {sorted(fields - grouped)}"
    assert not grouped - fields, f"groups name no such option: {sorted(grouped - fields)}"
    docs = field_docs(ServerConfig)
    assert docs["speculative"].startswith("Drafting, verified in the decode step")
    assert "host" in docs and "kv_cache_tokens" in docs  # the subclass's fields and the base class's

    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig)
    text = parser.format_help()
    assert "default: None" not in text
    assert "speculation options:" in text and "memory options:" in text
    actions = {a.dest: a for a in parser._actions}
    assert actions["speculative"].help.startswith("Drafting, verified in the decode step")
    assert actions["speculative"].help.endswith("(default: auto)")
    documented = [name for name in fields if name in docs]
    assert all(actions[name].help and actions[name].help[0] != "(" for name in documented)


def test_a_disable_field_is_a_positive_flag_and_the_old_spelling_still_works() -> None:
    from radixgen.cli import PRECEDENCE, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig)
    text = parser.format_help()
    assert "--radix-cache, --no-radix-cache" in text and "--disable-radix-cache" not in text
    assert PRECEDENCE in " ".join(text.split())

    def config(*argv: str) -> ServerConfig:
        result = config_from_args(parser.parse_args(list(argv)), ServerConfig)
        assert isinstance(result, ServerConfig)
        return result

    assert config().disable_radix_cache is False
    assert config("--no-radix-cache").disable_radix_cache is True
    assert config("--radix-cache").disable_radix_cache is False
    assert config("--disable-radix-cache").disable_radix_cache is True  # the old spelling, unlisted
