"""Typed errors a user can cause. Each message says what was expected and what came.

All are ``ValueError`` subclasses so plain Python callers can catch them generically; the
server maps them to HTTP 4xx in OpenAI's error shape.
"""

from __future__ import annotations


class RadixgenError(Exception):
    """Base of every error radixgen raises on purpose."""


class InvalidParamsError(RadixgenError, ValueError):
    """A sampling or request parameter is out of range or of the wrong type."""


class PromptTooLongError(RadixgenError, ValueError):
    """The prompt (plus the tokens asked for) does not fit in the model's context."""


class InvalidConstraintError(RadixgenError, ValueError):
    """A regex / JSON schema / choice list is malformed, unsupported or has an empty language."""


class UnenforceableConstraintError(InvalidConstraintError):
    """A constraint the backend that reads it best cannot enforce, and that the others would read
    more loosely still: it is refused rather than handed on (``grammar_backend="auto"``)."""


class OverloadedError(RadixgenError):
    """The engine's queue is full; retry later."""


class EngineDeadError(RadixgenError):
    """The engine loop stopped (crashed or shut down); no request can be served."""
