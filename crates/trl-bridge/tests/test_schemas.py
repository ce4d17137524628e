"""Tool schemas: the bridge's own builder (used when transformers is not installed) and its
use of transformers, each against transformers' ``get_json_schema``, key for key and in order
(a template renders the schema into the prompt)."""

from __future__ import annotations

import enum
import functools
import json
import sys
from typing import Any, Literal, Optional, Union

import pytest
from transformers.utils import get_json_schema

from async_grpo import _callables


def defaults(city: str, days: int = 3, metric: bool = True, scale: float = 1.5, note: str = "") -> str:
    """Gets the forecast.

    Args:
        city: The city.
        days: How many days ahead.
        metric: Celsius rather than Fahrenheit.
        scale: A factor.
        note: A note.
    """
    return city


def optional(
    query: Optional[str],
    limit: int | None = None,
    mode: Union[int, str] = 1,
    either: Optional[Union[str, int]] = None,
    ids: Optional[list[int]] = None,
) -> Optional[str]:
    """Searches.

    Args:
        query: What to look for.
        limit: At most this many.
        mode: A mode, by number or by name.
        either: A name or a number, or nothing.
        ids: Only these.
    """
    return query


def lists(
    names: list[str],
    grid: list[list[int]],
    pair: tuple[int, str],
    free: list,
    table: dict[str, int],
    anything: Any,
    loose: dict,
) -> list[str]:
    """Lists and tables.

    Args:
        names: Names.
        grid: Rows of numbers.
        pair: A number and a name.
        free: Anything, listed.
        table: Counts by name.
        anything: Anything at all.
        loose: A table of anything.
    """
    return names


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def literals(
    unit: Literal["c", "f"],
    color: Color,
    drink: str,
    level: Literal[1, 2, 3] = 1,
    mixed: Literal["a", 1] = "a",
    maybe: Optional[Literal["x", "y"]] = None,
) -> None:
    """Literals, an enum and choices.

    Args:
        unit: The unit.
        color: A colour.
        drink: The drink (choices: ["tea", "coffee"])
        level: The level.
        mixed: A letter or a number.
        maybe: One of two, or nothing.
    """


def docstrings(expression: str, steps: int, note: str = "") -> str:
    """Evaluates an arithmetic expression,
    spread over two lines.

    A second paragraph, with details: and a colon.

    Args:
        expression (str): Two integers and an operator,
            such as "3 + 4", over
            three lines.
        steps: How many steps. Each step:
            - parses: the text
            - evaluates: the tree
        note:
            Said on the next line.

    Returns:
        The value.

    Raises:
        ValueError: when it cannot.
    """
    return expression


def no_arguments() -> str:
    """Says hello."""
    return "hello"


def tagged(expression: str, tag: str, times: int = 1) -> str:
    """Tags an expression.

    Args:
        expression: The expression.
        tag: The tag.
        times: How often.
    """
    return tag * times + expression


class Calculator:
    """A callable object: its schema is its ``__call__``'s."""

    def __call__(self, a: int, b: Optional[int] = None) -> int:
        """Adds.

        Args:
            a: The first number.
            b: The second, if any.
        """
        return a + (b or 0)


class Environment:
    def lookup(self, key: str, exact: bool = False) -> str:
        """Looks a key up.

        Args:
            key: The key.
            exact: Whole keys only.
        """
        return key


def without(schema: dict[str, Any], *bound: str) -> dict[str, Any]:
    """A schema without the arguments a partial binds."""
    parameters = schema["parameters"]
    for name in bound:
        del parameters["properties"][name]
    if bound:
        parameters["required"] = [r for r in parameters["required"] if r not in bound]
    return schema


def expected(function: Any, name: str | None = None, bound: tuple[str, ...] = ()) -> dict[str, Any]:
    """transformers' schema, without the return type (the engine's tool spec has none) and the
    arguments a partial binds."""
    schema = get_json_schema(function)["function"]
    schema.pop("return", None)
    if name is not None:
        schema["name"] = name
    return without(schema, *bound)


CASES: list[tuple[str, Any, Any]] = [
    ("defaults", defaults, lambda: expected(defaults)),
    ("optional", optional, lambda: expected(optional)),
    ("lists", lists, lambda: expected(lists)),
    ("literals", literals, lambda: expected(literals)),
    ("docstrings", docstrings, lambda: expected(docstrings)),
    ("no_arguments", no_arguments, lambda: expected(no_arguments)),
    (
        "keyword_partial",
        {"function": functools.partial(tagged, tag="#"), "name": "keyword_partial"},
        lambda: expected(tagged, "keyword_partial", ("tag",)),
    ),
    (
        "positional_partial",
        {"function": functools.partial(tagged, "6 * 7"), "name": "positional_partial"},
        lambda: expected(tagged, "positional_partial", ("expression",)),
    ),
    (
        "callable_object",
        {"function": Calculator(), "name": "callable_object"},
        lambda: expected(Calculator().__call__, "callable_object"),
    ),
    # A bound method: named after the method, `self` not an argument.
    ("lookup", Environment().lookup, lambda: expected(Environment().lookup)),
]


@pytest.mark.parametrize("builder", ["fallback", "transformers"])
@pytest.mark.parametrize(("name", "tool", "want"), CASES, ids=[c[0] for c in CASES])
def test_each_schema_builder_writes_what_transformers_get_json_schema_writes(
    monkeypatch: pytest.MonkeyPatch, builder: str, name: str, tool: Any, want: Any
) -> None:
    schema = want()
    if builder == "fallback":
        # The bridge in an environment without transformers: `from transformers.utils import`
        # raises ImportError.
        monkeypatch.setitem(sys.modules, "transformers.utils", None)
    fallback_calls: list[str] = []
    derived = _callables._derived_schema

    def spy(tool_name: str, function: Any) -> dict[str, Any]:
        fallback_calls.append(tool_name)
        return derived(tool_name, function)

    monkeypatch.setattr(_callables, "_derived_schema", spy)
    entry = _callables.tool_entry(tool, 0)
    assert fallback_calls == ([name] if builder == "fallback" else []), "the schema came from the other builder"
    got = {"name": entry.name, "description": entry.description, "parameters": entry.parameters}
    assert got == schema
    assert json.dumps(got) == json.dumps(schema), "the same schema, with its keys in another order"
