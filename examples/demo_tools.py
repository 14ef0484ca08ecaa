"""Real tools for the `agentflash demo` agent task: files, arithmetic and SQL in a temp directory.

`Workspace` creates a temporary directory holding a sales table (`sales.csv`), a team's notes
(`notes.txt`) and a shop database (`shop.db`, SQLite), and deletes it on exit. `tools()` gives
the tools bound to it: list_files, read_file, write_file, calculate and sql_query. They do real
work without a network, so the demo times the runtime on genuine tool calls. `DEMO_TASK` is the
multi-turn task the demo agent is given. All content is fixed, so every run sees the same files.

    with Workspace() as ws:
        agent_tools = ws.tools()
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import re
import sqlite3
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

from agentflash.tool import Tool, tool

__all__ = ["DEMO_TASK", "Workspace", "calculate"]

DEMO_TASK: list[str] = [
    "List the files in the workspace.",
    "What were the total units sold in the north region? Read sales.csv.",
    "Compute 1234 * 5.5 with the calculator.",
    "Which product has the highest price? Query the database.",
    "Write a one-line summary to summary.txt.",
]
"""One task as successive user messages; each turn needs a different tool."""

SALES_CSV = """\
month,region,units,unit_price
2024-01,north,120,9.5
2024-01,south,95,9.5
2024-01,west,60,10.0
2024-02,north,135,9.5
2024-02,south,88,9.5
2024-02,west,72,10.0
2024-03,north,150,9.0
2024-03,south,101,9.0
2024-03,west,80,10.0
2024-04,north,142,9.0
2024-04,south,110,9.0
2024-04,west,91,10.5
"""

NOTES_TXT = """\
Team notes (Lantern Outdoor Co.)
- Mon: north region beat its March target; restock headlamps before April.
- Tue: south warehouse reports two damaged tent pallets; claim filed.
- Wed: price of the trail stove goes up next quarter.
- Thu: Priya owns the monthly sales summary; due Friday.
"""

PRODUCTS = [
    (1, "headlamp", 24.0), (2, "tent", 189.0), (3, "sleeping bag", 95.5),
    (4, "trail stove", 64.0), (5, "water filter", 39.9), (6, "backpack", 120.0),
    (7, "camp chair", 45.0), (8, "lantern", 29.5), (9, "rain jacket", 140.0),
    (10, "hiking poles", 55.0), (11, "first aid kit", 22.0), (12, "map case", 12.5),
]
"""products(id, name, price): the tent is the most expensive."""

ORDERS = [
    (1, 1, 3, "2024-03-01"), (2, 2, 1, "2024-03-01"), (3, 5, 2, "2024-03-02"),
    (4, 6, 1, "2024-03-02"), (5, 1, 5, "2024-03-03"), (6, 9, 2, "2024-03-03"),
    (7, 3, 1, "2024-03-04"), (8, 8, 4, "2024-03-04"), (9, 4, 2, "2024-03-05"),
    (10, 11, 6, "2024-03-05"), (11, 2, 2, "2024-03-06"), (12, 12, 3, "2024-03-06"),
]
"""orders(id, product_id, quantity, day)."""

MAX_READ_CHARS = 4000
MAX_SQL_ROWS = 50


class Workspace:
    """A temporary directory with the demo files; a context manager that deletes it on exit."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="agentflash-demo-")
        self.root = Path(self._dir.name).resolve()
        (self.root / "sales.csv").write_text(SALES_CSV, encoding="utf-8")
        (self.root / "notes.txt").write_text(NOTES_TXT, encoding="utf-8")
        self._db = self.root / "shop.db"
        with contextlib.closing(sqlite3.connect(self._db)) as db, db:
            db.execute("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL)")
            db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, product_id INTEGER "
                       "REFERENCES products(id), quantity INTEGER, day TEXT)")
            db.executemany("INSERT INTO products VALUES (?, ?, ?)", PRODUCTS)
            db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", ORDERS)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete the directory and everything in it."""
        self._dir.cleanup()

    def tools(self) -> list[Tool]:
        """The demo tools, bound to this workspace."""
        functions: list[Callable[..., Any]] = [
            self.list_files, self.read_file, self.write_file, calculate, self.sql_query]
        return [tool(fn) for fn in functions]

    def list_files(self) -> list[str]:
        """List the files in the workspace."""
        return sorted(p.relative_to(self.root).as_posix()
                      for p in self.root.rglob("*") if p.is_file())

    def read_file(self, path: str) -> str:
        """Read a text file from the workspace.

        Args:
            path: file name, e.g. sales.csv
        """
        return self._resolve(path).read_text(encoding="utf-8", errors="replace")[:MAX_READ_CHARS]

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the workspace.

        Args:
            path: file name, e.g. report.txt
            content: text to write
        """
        target = self._resolve(path)
        data = content.encode("utf-8")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return f"wrote {len(data)} bytes to {target.relative_to(self.root).as_posix()}"

    def sql_query(self, query: str) -> list[dict[str, Any]]:
        """Run one SELECT on shop.db: tables products(id, name, price) and
        orders(id, product_id, quantity, day).

        Args:
            query: a single SQL SELECT
        """
        if not _SELECT.match(query):
            raise ValueError("only a single SELECT (or WITH ... SELECT) statement is allowed")
        # Read-only at the connection, so neither a crafted WITH nor a second statement can write.
        uri = f"{self._db.as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            db.row_factory = sqlite3.Row
            # execute() itself refuses a string holding more than one statement.
            return [dict(row) for row in db.execute(query).fetchmany(MAX_SQL_ROWS)]

    def _resolve(self, path: str) -> Path:
        """`path` inside the workspace, with symlinks and `..` resolved; ValueError outside it."""
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise ValueError("path outside the workspace")
        return target


_SELECT = re.compile(r"\s*(SELECT|WITH)\b", re.IGNORECASE)

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "round": round, "abs": abs, "min": min, "max": max, "sqrt": math.sqrt}
MAX_EXPONENT = 100
MAX_POWER_BITS = 10_000
"""Integer powers whose result would need more bits than this are refused (10**3000 or so)."""


def calculate(expression: str) -> float | int:
    """Evaluate arithmetic: numbers, + - * / // % **, parentheses, round abs min max sqrt.

    Args:
        expression: e.g. (2 + 3) * 4.5
    """
    result = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(result, complex):  # e.g. (-8) ** 0.5
        raise ValueError(f"{expression} is not a real number")
    return result


def _evaluate(node: ast.expr) -> Any:
    """The value of an arithmetic expression tree; ValueError for anything not arithmetic."""
    match node:
        case ast.Constant(value=int() | float() as value) if not isinstance(value, bool):
            return value
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_evaluate(operand))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a, b = _evaluate(left), _evaluate(right)
            if isinstance(op, ast.Pow):
                _check_power(a, b)
            return _BINARY[type(op)](a, b)
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
            return _FUNCTIONS[name](*map(_evaluate, args))
    raise ValueError(f"{_describe(node)} is not allowed; use numbers, + - * / // % **, "
                     "parentheses and round/abs/min/max/sqrt")


def _check_power(base: Any, exponent: Any) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and (
            base.bit_length() * exponent > MAX_POWER_BITS):
        raise ValueError(f"the power is too large (over {MAX_POWER_BITS} bits)")


def _describe(node: ast.expr) -> str:
    match node:
        case ast.Name(id=name):
            return f"the name {name!r}"
        case ast.Attribute(attr=attr):
            return f"attribute access (.{attr})"
        case ast.Call(keywords=[_, *_]):
            return "a keyword argument"
        case ast.Call(func=ast.Name(id=name)):
            return f"the function {name!r}"
        case ast.Call(func=func):  # e.g. a method: name what is called
            return _describe(func)
        case ast.Constant(value=value):
            return f"the constant {value!r}"
        case ast.BinOp(op=op) | ast.UnaryOp(op=op):
            return f"the operator {type(op).__name__}"
    return f"{type(node).__name__} expressions"
