"""The error a request's bad field raises (its own module: the protocol and the tool
parsers both raise it, and neither imports the other for it)."""

from __future__ import annotations


class BadField(ValueError):
    """A request field with a value we refuse; becomes a 400 with `param` = the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
