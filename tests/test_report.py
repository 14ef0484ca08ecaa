"""The HTML run report (agentflash/report.py) and its browser check (tools/check_report.py).

Records are built from real `Usage` objects the way agentflash/telemetry.py writes them. The
Chromium test skips where /usr/bin/chromium is missing (and fails so under CI: tests/skips.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from agentflash.report import load_records, render_report, write_report
from agentflash.usage import (Cost, PromptTokensDetails, Speculative,
                              Timing, Usage)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from check_report import CHROMIUM, MIN_PNG_BYTES, check  # noqa: E402

import skips  # noqa: E402

EVIL = "<script>alert(1)</script>"


def make_usage(i: int, speculative: bool = True, priced: bool = True) -> Usage:
    """Plausible, distinct usage for step i (0-based): a block of 5 (4 draft positions)."""
    hist = {1: 2, 2: 3 + i, 3: 4, 5: 1 + i} if speculative else {}
    drafts, committed = sum(hist.values()), sum(t * c for t, c in hist.items())
    prompt, cached, completion = 400 + 120 * i, (300 + 100 * i) if i else 0, 30 + 7 * i
    timing = dict(queue_s=0.01 * i, prefill_s=0.05 + 0.01 * i, decode_s=0.3 + 0.02 * i,
                  tool_s=0.1 * (i % 2))
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        speculative=Speculative(
            drafts=drafts, draft_tokens=4 * drafts, accepted_tokens=committed - drafts,
            committed_tokens=committed,
            accepted_per_position=[sum(c for t, c in hist.items() if t - 1 > k)
                                   for k in range(4)] if speculative else [],
            acceptance_histogram=hist),
        timing=Timing(**timing, ttft_s=timing["queue_s"] + timing["prefill_s"],
                      total_s=sum(timing.values()) + 0.02),
        cost=Cost(usd=0.001 * (i + 1), saved_by_cache_usd=0.0004 * i,
                  saved_by_speculation_usd=0.0002 * (i + 1)) if priced else Cost(),
    )


def make_records(**kw: Any) -> list[dict[str, Any]]:
    """Two agents (planner: 3 steps, coder: 4), five tool calls, one of them failing."""
    records: list[dict[str, Any]] = []
    plan = [("a1", "planner", 1, 1), ("a1", "planner", 1, 2), ("a2", "coder", 1, 1),
            ("a2", "coder", 1, 2), ("a1", "planner", 2, 3), ("a2", "coder", 2, 3),
            ("a2", "coder", 2, 4)]
    tools = {("a1", 1): [("search", None)], ("a1", 2): [("search", "timeout")],
             ("a2", 1): [(EVIL, None), ("read_file", None)], ("a2", 3): [("read_file", None)]}
    for i, (agent_id, name, turn, step) in enumerate(plan):
        ids = {"run_id": "r1", "agent_id": agent_id, "session_id": f"s-{agent_id}"}
        calls = tools.get((agent_id, step), [])
        records.append({"type": "step", "ts": 1000.0 + 2 * i, **ids, "agent_name": name,
                        "turn": turn, "step": step, "model": "agentflash-11m",
                        "finish_reason": "stop", "tool_calls": [c for c, _ in calls],
                        "usage": make_usage(i, **kw).model_dump(mode="json")})
        records += [{"type": "tool", "ts": 1000.5 + 2 * i, **ids, "step": step,
                     "call_id": f"c{i}{j}", "name": c, "error": err, "elapsed_s": 0.05 * (j + 1)}
                    for j, (c, err) in enumerate(calls)]
    return records


def tile(page: str, key: str) -> tuple[str, str]:
    """The value and the line under it of a header tile."""
    m = re.search(rf'<div class="k">{re.escape(key)}</div><div class="v">([^<]*)</div>'
                  r'<div class="s">([^<]*)</div>', page)
    assert m, key
    return m.group(1), m.group(2)


def row(page: str, first_cell: str) -> list[str]:
    """The cells (tags stripped) of the table row whose first cell is `first_cell`."""
    for tr in re.findall(r"<tr>(.*?)</tr>", page):
        cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r}")


def test_report_page_and_totals():
    records = make_records()
    page = render_report(records, title="demo")
    assert page.startswith("<!DOCTYPE html>") and page.count("<html") == 1
    assert page.rstrip().endswith("</html>")
    assert not re.search(r"https?://", page)                   # nothing external
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<svg") == 6                                # every chart drawn

    usages = [Usage.model_validate(r["usage"]) for r in records if r["type"] == "step"]
    total = Usage.sum(usages)
    cached = total.prompt_tokens_details.cached_tokens / total.prompt_tokens
    assert tile(page, "Prompt tokens") == (f"{total.prompt_tokens:,}",
                                           f"cached {100 * cached:.1f} %")
    assert tile(page, "Steps")[0] == "7" and tile(page, "Agents")[0] == "2"
    assert tile(page, "Tool calls") == ("5", "1 error")
    assert tile(page, "Wall span")[0] == "12.00 s"                # ts 1000 .. 1012
    assert tile(page, "Model")[0] == "agentflash-11m"
    assert tile(page, "Mean acceptance τ")[0] == (
        f"{total.speculative.committed_tokens / total.speculative.drafts:.2f}")
    assert tile(page, "Cost") == ("$0.028", "saved: cache $0.0084 · speculation $0.0056")

    planner = Usage.sum(usages[i] for i in (0, 1, 4))
    assert row(page, "planner")[:5] == ["planner", "3", "2", "1", f"{planner.prompt_tokens:,}"]
    assert row(page, "coder")[:4] == ["coder", "4", "3", "0"]
    assert row(page, "search")[:3] == ["search", "2", "1"]
    assert row(page, "search")[-1] == "timeout ×1"
    assert row(page, "read_file")[:3] == ["read_file", "2", "0"]
    assert row(page, "&lt;script&gt;alert(1)&lt;/script&gt;")[1] == "1"


def test_speculation_off_and_no_pricing():
    page = render_report(make_records(speculative=False, priced=False))
    assert "Speculation off" in page and tile(page, "Mean acceptance τ")[0] == "speculation off"
    assert "No pricing set" in page and tile(page, "Cost")[0] == "no pricing set"
    assert page.count("<svg") == 3                                # latency, prompt, completion


def test_single_step_many_steps_and_no_steps():
    one = make_records()[:1]
    assert render_report(one).count("<svg") == 6
    many = [dict(r, ts=r["ts"] + 20 * k, step=r["step"] + 10 * k)
            for k in range(50) for r in make_records() if r["type"] == "step"]
    page = render_report(many)
    widths = [int(w) for w in re.findall(r'<svg width="(\d+)"', page)]
    assert max(widths) >= 350 * 6                                 # bars keep a minimum pitch
    assert "No model steps" in render_report([{"type": "tool", "ts": 1.0, "agent_id": "a",
                                               "name": "t", "error": None, "elapsed_s": 0.1}])


def test_load_records_ignores_unknown_types_and_rejects_malformed_lines(tmp_path):
    records = make_records()
    log = tmp_path / "run.jsonl"
    lines = [json.dumps(r) for r in records]
    log.write_text("\n".join(lines[:2] + ['{"type": "future", "x": 1}'] + lines[2:]) + "\n")
    assert load_records(log)[2] == {"type": "future", "x": 1}
    assert render_report(load_records(log)) == render_report(records)
    out = write_report(log, tmp_path / "run.html")
    assert out.read_text().count("<svg") == 6 and "run.jsonl" in out.read_text()

    log.write_text("\n".join(lines[:2] + ['{"type": "step", "ts": '] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match="line 3 is not JSON"):
        load_records(log)


def need_chromium() -> str:
    """Chromium's path (the test skips without it; under CI it fails: tests/skips.py)."""
    skips.CHROMIUM.need()
    return CHROMIUM


def test_report_renders_in_chromium(tmp_path):
    chromium = need_chromium()
    page = tmp_path / "report.html"
    page.write_text(render_report(make_records()), encoding="utf-8")
    shot = tmp_path / "report.png"
    assert check(page, shot, chromium) == []
    assert shot.stat().st_size > MIN_PNG_BYTES


def test_check_reports_page_errors(tmp_path):
    chromium = need_chromium()
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><p>x</p><svg width="9" height="9"></svg>'
                    '<script>throw new Error("x")</script></body></html>')
    problems = check(page, tmp_path / "bad.png", chromium)
    assert any("Uncaught Error: x" in p for p in problems), problems
    assert any("looks empty" in p for p in problems), problems    # a near-blank screenshot
    assert not any("<svg>" in p for p in problems), problems      # its one svg rendered
