"""Per-step accounting on real runs of the embedded model: Usage invariants, costs and their
counterfactual savings, the JSONL run log, and OpenTelemetry GenAI spans."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from agentflash import Agent, Runtime, tool
from agentflash.usage import Pricing, Usage

HOURLY = Pricing(usd_per_hour=3.6)          # 1e-3 USD per second of compute
TOKENS = Pricing(input_per_1m=2.0, cached_input_per_1m=0.5, output_per_1m=8.0)
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    runtime = Runtime.load(pricing=HOURLY, log=tmp_path_factory.mktemp("log") / "run.jsonl")
    yield runtime
    runtime.close()


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def check_invariants(u: Usage) -> None:
    assert u.prompt_tokens == u.prompt_tokens_details.cached_tokens + \
        u.compute.prefill_tokens_computed
    d = u.completion_tokens_details
    # Predicted Outputs only (OpenAI's meaning): agents send no prediction; DFlash counts apart
    assert d.accepted_prediction_tokens == d.rejected_prediction_tokens == 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    t = u.timing
    assert t.queue_s + t.prefill_s + t.decode_s + t.tool_s <= t.total_s + 1e-6
    assert t.ttft_s <= t.total_s and t.grammar_s <= t.total_s
    assert u.cost.usd > 0
    if u.speculative.drafts:
        assert sum(u.speculative.acceptance_histogram.values()) == u.speculative.drafts
        assert u.speculative.committed_tokens == sum(
            tau * n for tau, n in u.speculative.acceptance_histogram.items())


@pytest.mark.anyio
async def test_invariants_and_run_totals(rt):
    async with Agent(rt, "Be brief.", tools=[add], max_tokens=48) as agent:
        result = await agent.run("Add 2 and 3 with the add tool.", max_steps=3)
        second = await agent.run("Now add 4 and 5.", max_steps=3)
    for step in result.steps + second.steps:
        check_invariants(step.usage)
    total = result.usage
    check_invariants(total)
    for field in ("prompt_tokens", "completion_tokens"):
        assert getattr(total, field) == sum(getattr(s.usage, field) for s in result.steps)
    assert total.timing.total_s == pytest.approx(sum(s.usage.timing.total_s
                                                     for s in result.steps))
    assert total.cost.usd == pytest.approx(sum(s.usage.cost.usd for s in result.steps))
    assert total.speculative.mean_acceptance_length == pytest.approx(
        total.speculative.committed_tokens / total.speculative.drafts)
    later = second.steps[0].usage
    assert later.prompt_tokens_details.cached_tokens > 0
    assert later.cost.saved_by_cache_usd > 0


@pytest.mark.anyio
async def test_savings_are_zero_when_caching_or_speculation_is_off(rt):
    rt.clear_cache()
    async with Agent(rt, tools=[add], max_tokens=32, reuse_kv=False) as agent:
        await agent.step("Add 1 and 2.")
        step = await agent.step("Add 3 and 4.")
    assert step.usage.prompt_tokens_details.cached_tokens == 0
    assert step.usage.cost.saved_by_cache_usd == 0
    assert step.usage.cost.saved_by_speculation_usd != 0
    async with Agent(rt, tools=[add], max_tokens=32, speculative=False) as agent:
        step = await agent.step("Add 5 and 6.")
    assert step.usage.speculative.drafts == 0 and step.usage.cost.saved_by_speculation_usd == 0
    check_invariants(step.usage)


def test_token_pricing_is_the_price_sheet():
    from agentflash.engine.sequence import SeqCounters

    c = SeqCounters(cached_tokens=600, prefill_tokens=400)
    u = Usage.from_counters(c, 1000, 100, 10, 0, 16, "cpu", 0.0, 1.0, TOKENS)
    assert u.cost.usd == pytest.approx((400 * 2.0 + 600 * 0.5 + 100 * 8.0) / 1e6)
    assert u.cost.saved_by_cache_usd == pytest.approx(600 * 1.5 / 1e6)
    assert u.cost.saved_by_speculation_usd == 0
    for bad in ({}, {"usd_per_hour": 1, "input_per_1m": 1}, {"input_per_1m": 1},
                {"usd_per_hour": -1}):
        with pytest.raises(ValidationError):
            Pricing(**bad)


def test_savings_are_priced_at_the_speed_the_step_ran():
    """The counterfactuals come from the step's own counters: speculation saved the plain
    steps for what it committed minus its verify steps and drafter forwards; the cache saved
    what computing the cached tokens would have added to the prefill it ran."""
    from agentflash.engine.sequence import SeqCounters

    c = SeqCounters(cached_tokens=600, prefill_tokens=400, prefill_compute_s=0.040,
                    prefill_units=4.0, recompute_units=10.0, draft_forwards=3,
                    draft_compute_s=0.002, speculated_s=0.006, plain_equivalent_s=0.017)
    u = Usage.from_counters(c, 1000, 23, 10, 0, 16, "cpu", 0.0, 1.0, HOURLY)
    assert u.cost.saved_by_cache_usd == pytest.approx(0.040 * (10 / 4 - 1) * 1e-3)
    assert u.cost.saved_by_speculation_usd == pytest.approx((0.017 - 0.006 - 0.002) * 1e-3)
    # what cannot be known says so: no step costs, no prefill cost
    unknown = SeqCounters(cached_tokens=600, prefill_tokens=400, lookups=2,
                          plain_equivalent_s=None, prefill_units=None, recompute_units=None)
    w = Usage.from_counters(unknown, 1000, 23, 10, 0, 16, "cpu", 0.0, 1.0, HOURLY)
    assert w.cost.saved_by_cache_usd is None and w.cost.saved_by_speculation_usd is None
    assert (u + w).cost.saved_by_cache_usd is None  # a sum with an unknown term is unknown
    none = SeqCounters(prefill_tokens=400, prefill_units=None, plain_equivalent_s=None)
    x = Usage.from_counters(none, 400, 23, 10, 0, 16, "cpu", 0.0, 1.0, HOURLY)
    assert x.cost.saved_by_cache_usd == 0 and x.cost.saved_by_speculation_usd == 0


def test_the_slowdown_is_recent_time_over_time_at_load():
    from agentflash.engine.slowdown import Slowdown

    s = Slowdown()
    assert s.factor is None
    for _ in range(50):
        s.add(0.002, 0.002)
    assert s.factor == pytest.approx(1.0)
    for _ in range(1000):  # the machine gets three times slower: the factor follows
        s.add(0.006, 0.002)
    assert s.factor == pytest.approx(3.0, rel=1e-3)
    s.add(0.100, 0.002)  # one forward the OS delayed moves it by its share only
    assert s.factor < 3.6


def test_the_prefill_cost_shape_is_fitted_through_its_measurements():
    from agentflash.engine.config import PrefillCost

    shape = PrefillCost(fixed=3.0, per_token=0.05, per_pair=1e-5)
    times = (shape.units(256, 0), shape.units(16, 0), shape.units(256, 1024))
    fitted = PrefillCost.fit(256, 16, 1024, *times)
    assert fitted.fixed == pytest.approx(3.0) and fitted.per_token == pytest.approx(0.05)
    assert fitted.per_pair == pytest.approx(1e-5)
    # attention grows with the context: a token costs more after more keys
    assert shape.units(100, 2000) > shape.units(100, 0)
    # chunks of 512: 1200 positions are three forwards
    assert shape.chunked(1200, 512) == pytest.approx(
        shape.units(512, 0) + shape.units(512, 512) + shape.units(176, 1024))


@pytest.mark.anyio
async def test_the_engine_counts_both_counterfactuals(rt):
    """A turn that hits the cache and speculates has both counterfactuals counted at load's
    costs; a runtime without step costs (speculation="always") knows no speculation saving."""
    assert rt.engine.prefill_cost is not None
    async with Agent(rt, "Be brief.", tools=[add], max_tokens=48) as agent:
        await agent.step("Add 2 and 3 with the add tool.")
        step = await agent.step("Now add 4 and 5.")
    assert step.usage.prompt_tokens_details.cached_tokens > 0
    assert step.usage.cost.saved_by_cache_usd > 0
    assert step.usage.cost.saved_by_speculation_usd is not None
    always = Runtime.load(pricing=HOURLY, speculation="always")
    try:
        async with Agent(always, tools=[add], max_tokens=32) as agent:
            step = await agent.step("Add 5 and 6.")
        assert step.usage.speculative.drafts > 0
        assert step.usage.cost.saved_by_speculation_usd is None
    finally:
        always.close()


@pytest.mark.anyio
async def test_run_log_has_a_record_per_step_and_tool_call(rt):
    before = len(rt.log.path.read_text().splitlines())
    async with Agent(rt, tools=[add], max_tokens=40, name="logger") as agent:
        result = await agent.run("Add 6 and 7 with the add tool.", max_steps=3)
    records = [json.loads(line) for line in rt.log.path.read_text().splitlines()[before:]]
    steps = [r for r in records if r["type"] == "step"]
    tools = [r for r in records if r["type"] == "tool"]
    assert len(steps) == len(result.steps)
    assert len(tools) == sum(len(s.tool_results) for s in result.steps)
    assert {r["agent_id"] for r in records} == {"logger"}
    assert len({r["run_id"] for r in records}) == 1
    assert {r["session_id"] for r in records} == {agent.session_id}
    for record, step in zip(steps, result.steps):
        assert Usage.model_validate(record["usage"]) == step.usage
        assert record["tool_calls"] == [c.name for c in step.tool_calls]


@pytest.mark.anyio
async def test_opentelemetry_genai_spans(rt):
    EXPORTER.clear()
    async with Agent(rt, tools=[add], max_tokens=40, name="otel") as agent:
        result = await agent.run("Add 8 and 9 with the add tool.", max_steps=3)
    spans = EXPORTER.get_finished_spans()
    runs = [s for s in spans if s.name == "invoke_agent otel"]
    chats = [s for s in spans if s.name == f"chat {rt.model_name}"]
    tools = [s for s in spans if s.name.startswith("execute_tool ")]
    assert len(runs) == 1 and len(chats) == len(result.steps)
    assert len(tools) == sum(len(s.tool_results) for s in result.steps)
    run = runs[0]
    for span, step in zip(chats, result.steps):
        a = span.attributes
        assert span.parent.span_id == run.context.span_id
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.usage.input_tokens"] == step.usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == step.usage.completion_tokens
        assert a["gen_ai.usage.cache_read.input_tokens"] == \
            step.usage.prompt_tokens_details.cached_tokens
        assert a["gen_ai.usage.details.accepted_prediction_tokens"] == \
            step.usage.completion_tokens_details.accepted_prediction_tokens
    for span in tools:
        assert span.attributes["gen_ai.tool.name"] == "add"
        assert span.parent.span_id == run.context.span_id


def test_load_measures_step_costs_and_the_prefill_shape(rt):
    cost = rt.engine.policy.spec.cost  # speculation="auto" serves with them
    assert cost is not None and cost.verify[0] == 1.0 and cost.draft[0] == 0.0
    assert len(cost.verify) == len(cost.draft) == rt.engine.block_size
    assert min(cost.draft[1:]) > 0  # a drafter forward for every verify length
    assert [c.batch for c in rt.engine.policy.spec.batch_costs] == [4, 16]
    assert rt.engine.policy.spec.long_cost.context > cost.context
    shape = rt.engine.prefill_cost
    assert shape.units(256, 0) > shape.units(16, 0) > 0
