"""The demo workspace and its tools, run for real: files, path confinement, safe arithmetic and
read-only SQL."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentflash.tool import Tool, ToolOutcome
from agentflash.examples.demo_tools import DEMO_TASK, Workspace, calculate


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ws() -> Iterator[Workspace]:
    with Workspace() as workspace:
        yield workspace


async def run(ws: Workspace, name: str, **arguments: object) -> ToolOutcome:
    tools: dict[str, Tool] = {t.name: t for t in ws.tools()}
    return await tools[name].execute(arguments)


def test_workspace_files_exist_and_are_deleted_on_exit() -> None:
    with Workspace() as ws:
        root = ws.root
        assert {p.name for p in root.iterdir()} == {"sales.csv", "notes.txt", "shop.db"}
        assert len((root / "sales.csv").read_text().splitlines()) == 13  # header + 12 rows
        with sqlite3.connect(root / "shop.db") as db:
            counts = [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                      for t in ("products", "orders")]
        assert counts == [12, 12]
    assert not root.exists()


def test_tools_and_task() -> None:
    with Workspace() as ws:
        tools = ws.tools()
    assert [t.name for t in tools] == [
        "list_files", "read_file", "write_file", "calculate", "sql_query"]
    for t in tools:
        assert t.description and "\n" not in t.description
    assert 4 <= len(DEMO_TASK) <= 5 and all(isinstance(m, str) and m for m in DEMO_TASK)


@pytest.mark.anyio
async def test_list_and_read_files(ws: Workspace) -> None:
    listed = await run(ws, "list_files")
    assert listed.error is None
    assert json.loads(listed.content) == ["notes.txt", "sales.csv", "shop.db"]
    read = await run(ws, "read_file", path="sales.csv")
    assert read.error is None
    assert read.content == (ws.root / "sales.csv").read_text()
    assert read.content.startswith("month,region,units,unit_price\n")


@pytest.mark.anyio
async def test_read_file_is_truncated(ws: Workspace) -> None:
    (ws.root / "big.txt").write_text("x" * 10_000)
    assert len((await run(ws, "read_file", path="big.txt")).content) == 4000


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["../outside.txt", "/etc/hostname", "sub/../../x.txt"])
async def test_paths_outside_the_workspace_are_refused(ws: Workspace, path: str) -> None:
    read = await run(ws, "read_file", path=path)
    assert read.error == "exception" and "path outside the workspace" in read.content
    write = await run(ws, "write_file", path=path, content="no")
    assert write.error == "exception" and "path outside the workspace" in write.content
    assert not (ws.root.parent / "outside.txt").exists()


@pytest.mark.anyio
async def test_symlink_out_of_the_workspace_is_refused(ws: Workspace, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("secret")
    (ws.root / "link.txt").symlink_to(tmp_path / "secret.txt")
    assert (await run(ws, "read_file", path="link.txt")).error == "exception"


@pytest.mark.anyio
async def test_write_then_read_round_trip(ws: Workspace) -> None:
    text = "North sold 547 units; the tent is the priciest product. ✓"
    written = await run(ws, "write_file", path="out/summary.txt", content=text)
    assert written.error is None
    assert written.content == f"wrote {len(text.encode())} bytes to out/summary.txt"
    assert (await run(ws, "read_file", path="out/summary.txt")).content == text
    assert "out/summary.txt" in json.loads((await run(ws, "list_files")).content)


@pytest.mark.parametrize("expression, expected", [
    ("1234 * 5.5", 6787.0),
    ("(2 + 3) * 4", 20),
    ("7 // 2 + 7 % 2 - -1", 5),
    ("2 ** 10 / 4", 256.0),
    ("+3 - 5", -2),
    ("round(2.345, 2) + abs(-1)", 3.35),
    ("max(1, 9, 4) - min(3, 2)", 7),
    ("sqrt(16)", 4.0),
    ("2 ** -2", 0.25),
])
def test_calculate_results(expression: str, expected: float) -> None:
    result = calculate(expression)
    assert result == pytest.approx(expected) and type(result) is type(expected)


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "the name 'x'"),
    ("(2).real", "attribute access (.real)"),
    ("__import__('os').system('true')", "attribute access (.system)"),
    ("open('sales.csv')", "the function 'open'"),
    ("pow(2, 3)", "the function 'pow'"),
    ("round(2.5, ndigits=0)", "a keyword argument"),
    ("'a' * 3", "the constant 'a'"),
    ("True + 1", "the constant True"),
    ("1 < 2", "Compare expressions"),
    ("6 & 3", "the operator BitAnd"),
    ("[1, 2]", "List expressions"),
    ("lambda: 1", "Lambda expressions"),
    ("2 ** 101", "exponent 101 is too large"),
    ("10 ** 99 ** 99", "exponent"),
    ("(9 ** 99) ** 99", "is too large"),
    ("(-8) ** 0.5", "not a real number"),
])
def test_calculate_rejections(expression: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        calculate(expression)
    assert message in str(info.value)


@pytest.mark.anyio
async def test_calculate_tool(ws: Workspace) -> None:
    assert (await run(ws, "calculate", expression="1234 * 5.5")).content == "6787.0"
    refused = await run(ws, "calculate", expression="__import__('os')")
    assert refused.error == "exception" and "'__import__' is not allowed" in refused.content


def db_snapshot(ws: Workspace) -> list[tuple]:
    with sqlite3.connect(ws.root / "shop.db") as db:
        return [tuple(r) for t in ("products", "orders")
                for r in db.execute(f"SELECT * FROM {t} ORDER BY id")]


@pytest.mark.anyio
async def test_sql_query_returns_rows(ws: Workspace) -> None:
    top = await run(ws, "sql_query",
                    query="SELECT name, price FROM products ORDER BY price DESC LIMIT 2")
    assert top.error is None
    assert json.loads(top.content) == [{"name": "tent", "price": 189.0},
                                       {"name": "rain jacket", "price": 140.0}]
    joined = await run(ws, "sql_query", query=(
        "WITH q AS (SELECT product_id, SUM(quantity) AS n FROM orders GROUP BY product_id) "
        "SELECT p.name, q.n FROM q JOIN products p ON p.id = q.product_id "
        "WHERE p.name = 'headlamp';"))
    assert json.loads(joined.content) == [{"name": "headlamp", "n": 8}]
    many = await run(ws, "sql_query", query=(
        "SELECT a.id FROM orders a, orders b"))  # 144 rows, capped
    assert len(json.loads(many.content)) == 50


@pytest.mark.anyio
@pytest.mark.parametrize("query", [
    "INSERT INTO products VALUES (13, 'kayak', 999.0)",
    "DELETE FROM orders",
    "SELECT 1; DELETE FROM orders",
    "SELECT 1; DROP TABLE products",
    "WITH x AS (SELECT 1) DELETE FROM orders",
    "UPDATE products SET price = 0",
    "ATTACH DATABASE 'other.db' AS other",
])
async def test_sql_query_refuses_writes(ws: Workspace, query: str) -> None:
    before = db_snapshot(ws)
    outcome = await run(ws, "sql_query", query=query)
    assert outcome.error == "exception"
    assert db_snapshot(ws) == before
    assert sorted(p.name for p in ws.root.iterdir()) == ["notes.txt", "sales.csv", "shop.db"]
