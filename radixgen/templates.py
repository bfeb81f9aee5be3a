"""How prompts are laid out for a model's chat template, shared by the server and the DSL.

Role markers: the DSL's role blocks are rendered with the model's own chat template. A block's text is what the template puts around a message of that role. We find it by rendering
a message whose content is a marker and splitting there, so any template works without a table
of formats. A conversation's first block is rendered on its own, because templates may add text
only at the start (SmolLM2 inserts a default system prompt before a first user message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")

_MARKER = "\x00radixgen-marker\x00"


@dataclass(frozen=True)
class RoleMarkers:
    """Text before and after a message of each role; ``first`` when the block opens the text."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    first_prefix: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "suffix": self.suffix, "first_prefix": self.first_prefix}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoleMarkers:
        return cls(dict(data["prefix"]), dict(data["suffix"]), dict(data["first_prefix"]))


def _split(text: str, what: str) -> tuple[str, str]:
    if text.count(_MARKER) != 1:
        raise ValueError(f"the chat template does not render a {what} message's content verbatim")
    before, after = text.split(_MARKER)
    return before, after


def role_markers(tokenizer: Any) -> RoleMarkers:
    """Prefix and suffix of every role under ``tokenizer``'s chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; role blocks need one")

    def render(messages: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))

    context = [{"role": "system", "content": "S"}]
    base = render(context)
    prefix, suffix, first = {}, {}, {}
    for role in ROLES:
        first[role], _ = _split(render([{"role": role, "content": _MARKER}]), role)
        text = render([*context, {"role": role, "content": _MARKER}])
        if not text.startswith(base):
            raise ValueError(f"the chat template renders a {role} message differently after a system message")
        prefix[role], suffix[role] = _split(text[len(base):], role)
    return RoleMarkers(prefix, suffix, first)
