"""How well speculation="auto" chooses its verify lengths, without a clock: a replay that no
machine's noise moves.

    python tools/eval_policy.py [--prompts bench|test] [--quantize int8] [--costs F] [--eos]
                                [--decide-with G]

Greedy acceptance is deterministic: at every anchor the drafter's block, and so how many of its
drafts the target accepts, depends only on the prompt and the tokens before it. With one fixed
table of step costs (measured once here, or read from --costs, a JSON this tool writes), a
policy's run therefore has a deterministic cost: the sum over its steps of the drafter's
forward for the drafts it computed plus the verify of the tokens it fed, in plain steps. This
tool prints tokens committed per plain step of that cost (the modeled speedup over plain
decoding, the drafter's context store not counted) for:
- the engine's own policy (speculation="auto" with these costs), run for real, with and without
  its context drafts (engine.lookup: a step that verifies those costs a verify, no drafter);
- every fixed verify length k (a drafter forward of k - 1 drafts and a verify of k tokens each
  step), and the best any policy could do knowing each anchor's acceptance in hindsight
  (dynamic programming over the positions): the first run records the drafter's block at every
  anchor of plain decoding.
Two codes alternated on a noisy machine need many rounds to show a 5% difference; here one run
each shows it exactly (the costs only set the exchange rate). Wall-clock speed is
tools/bench_peers.py's and tools/eval_drafter.py's.

--prompts bench: tools/bench_peers.py's held-out agent prompts (--count of them, 500-3000
tokens); test: tools/eval_drafter.py's sample of the test split (6 per length bucket).
--eos: stop at eos (an agent's requests do), else 128 tokens past it, as bench_peers does.
--decide-with G: the engine's policy decides with the costs in G, and is scored with --costs
(say G as measured at load, --costs as the decode loop pays them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
from agentflash.engine.calibration import measure_step_cost  # noqa: E402
from agentflash.engine.config import SpecConfig, StepCost  # noqa: E402
from agentflash.engine.engine import Engine  # noqa: E402
from agentflash.engine.sampler import SamplingParams  # noqa: E402
from agentflash.engine.batch import BatchItem  # noqa: E402


def measured_costs(engine: Engine, rounds: int = 3) -> dict:
    """The batch-1 costs at 256 and 2048 tokens of context, each the median of `rounds`."""
    def median_of(context: int) -> dict:
        runs = [measure_step_cost(engine, context=context, steps=16) for _ in range(rounds)]
        mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out = dataclasses.asdict(runs[0])
        for key in ("draft", "verify"):
            out[key] = [mid([getattr(r, key)[i] for r in runs]) for i in range(len(runs[0].draft))]
        out["plain_s"] = mid([r.plain_s for r in runs])
        return out
    return {"cost": median_of(256), "long": median_of(2048)}


def step_cost(d: dict) -> StepCost:
    return StepCost(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def replay(engine: Engine, prompts: list[list[int]], params: SamplingParams,
           scored: SpecConfig) -> float:
    """The engine's own policy (deciding with engine.policy.spec's costs): tokens per plain step of
    modeled cost, by `scored`'s costs."""
    rows: list[int] = []
    draft = engine.runner.drafter.draft

    def counted(items, block_size, drafts):   # the drafter's rows this step
        rows.append(drafts)
        return draft(items, block_size, drafts)

    engine.runner.drafter.draft = counted
    tokens, cost = 0, 0.0
    try:
        for prompt in prompts:
            seq_id = engine.submit(prompt, params, reuse=False)
            seq = engine.sequence(seq_id)
            while engine.has_work():
                context, prefilling = seq.num_tokens, seq.prefilling
                rows.clear()
                for u in engine.step():
                    if u.seq_id == seq_id and u.new_token_ids and not prefilling:
                        c = scored.cost_at(1, context)
                        cost += ((c.draft[rows[0]] if rows else 0.0)
                                 + c.verify[u.draft_tokens + u.lookup_tokens])
                        tokens += len(u.new_token_ids)
    finally:
        engine.runner.drafter.draft = draft
    return tokens / cost


def anchors(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[int, dict]:
    """Plain decoding with the drafter's whole block drafted at every anchor: the output's
    length and, per anchor (tokens committed before it), how many leading drafts match."""
    seq_id = engine.submit(prompt, params, reuse=False, speculative=False)
    seq = engine.sequence(seq_id)
    blocks: dict[int, list[int]] = {}
    n = engine.block_size - 1
    while engine.has_work():
        if seq.output_ids and not seq.prefilling and seq.finish_reason is None:
            proposal = engine.runner.drafter.propose([BatchItem(seq, n + 1)], engine.block_size, n)
            blocks[len(seq.output_ids)] = proposal.drafts[0]
        engine.step()
    out = engine.result(seq_id).output_ids
    accepted = {}
    for t, block in blocks.items():
        a = 0
        while a < n and t + a < len(out) and block[a] == out[t + a]:
            a += 1
        accepted[t] = a
    return len(out), accepted


def hindsight(engine: Engine, runs: list[tuple[int, int, dict]]) -> dict[str, float]:
    """Fixed verify lengths and the hindsight optimum over the recorded anchors."""
    block = engine.block_size
    result = {}
    fixed = {k: [0, 0.0] for k in range(1, block + 1)}
    best_tokens, best_cost = 0, 0.0
    for length, out_len, accepted in runs:
        def commits(t: int, k: int) -> int:
            return min(min(accepted.get(t, 0), k - 1) + 1, out_len - t)
        best = [0.0] * (out_len + 1)
        for t in range(out_len - 1, 0, -1):
            c = engine.policy.spec.cost_at(1, length + t)
            best[t] = min((c.speculative(k) if k > 1 else 1.0) + best[t + commits(t, k)]
                          for k in range(1, block + 1))
        best_tokens += out_len - 1
        best_cost += best[1] if out_len > 1 else 0.0
        for k in range(1, block + 1):
            t = 1
            while t < out_len:
                c = engine.policy.spec.cost_at(1, length + t)
                fixed[k][1] += c.speculative(k) if k > 1 else 1.0
                fixed[k][0] += commits(t, k)
                t += commits(t, k)
    for k in (2, 3, 4, 5, 6, 8, block):
        result[f"k={k}"] = fixed[k][0] / fixed[k][1]
    result["hindsight"] = best_tokens / best_cost
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", choices=["bench", "test"], default="bench")
    ap.add_argument("--count", type=int, default=12, help="bench prompts")
    ap.add_argument("--quantize", choices=["int8"], default=None)
    ap.add_argument("--eos", action="store_true")
    ap.add_argument("--costs", type=Path, help="step costs JSON (written here if missing)")
    ap.add_argument("--decide-with", type=Path, help="step costs JSON the policy decides with")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/agentflash-peers").expanduser())
    args = ap.parse_args()

    model = bench_peers.EMBEDDED
    engine = Engine.from_dir(model, draft=model / "drafter", quantize=args.quantize,
                             speculation="always")
    if args.prompts == "bench":
        prompts = bench_peers.agent_prompts(args.cache, args.count)
    else:
        import eval_drafter
        from corpus import Tokenized
        from transformers import AutoTokenizer
        enc = Tokenized(AutoTokenizer.from_pretrained(str(model)))
        prompts = [list(p.ids) for p in eval_drafter.sample_prompts(
            str(args.cache / "corpus" / "test.jsonl"), enc, 6, engine.max_model_len - 128, 0)]
    params = SamplingParams(max_new_tokens=128, ignore_eos=not args.eos)
    with torch.inference_mode():
        if args.costs is not None and args.costs.exists():
            costs = json.loads(args.costs.read_text())
        else:
            costs = measured_costs(engine)
            if args.costs is not None:
                args.costs.write_text(json.dumps(costs))
        engine.policy.spec = dataclasses.replace(engine.policy.spec, cost=step_cost(costs["cost"]),
                                          long_cost=step_cost(costs["long"]))
        stop = "stopping at eos" if args.eos else "128 tokens past eos"
        print(f"{len(prompts)} {args.prompts} prompts, {stop}, {args.quantize or 'bf16'}; "
              "tokens per plain step of modeled cost:")
        scored = engine.policy.spec
        if args.decide_with is not None:
            decide = json.loads(args.decide_with.read_text())
            engine.policy.spec = dataclasses.replace(scored, cost=step_cost(decide["cost"]),
                                              long_cost=step_cost(decide["long"]))
        print(f"  auto (this engine's policy): {replay(engine, prompts, params, scored):.3f}")
        no_lookup = dataclasses.replace(engine.policy.spec, lookup=False)
        engine.policy.spec, decided = no_lookup, engine.policy.spec
        print(f"  auto without context drafts: {replay(engine, prompts, params, scored):.3f}")
        engine.policy.spec = decided
        engine.policy.spec = scored  # the fixed lengths and hindsight by the scoring costs
        runs = [(len(p), *anchors(engine, p, params)) for p in prompts]
        for name, value in hindsight(engine, runs).items():
            print(f"  {name}: {value:.3f}")


if __name__ == "__main__":
    main()
