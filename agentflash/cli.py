"""The `agentflash` command line: `demo` (an agent task on the embedded model), `report` (an
HTML dashboard from a run log) and `generate`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.device import resolve_device, resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.errors import EngineError
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams

from .errors import AgentflashError
from .embedded import EMBEDDED_MODEL, model_drafter_dir, resolve_model
from .tokenizer import load_tokenizer

MEASURE_TOKENS = 2600
"""KV pool room `generate` gives speculation="auto" to measure step costs in (a 2048-token
context and the measured steps)."""


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers: {text!r}")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with a local model")
    p.add_argument("--model", default=None,
                   help=f"Hugging Face model directory (default: the embedded {EMBEDDED_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer files in the model directory)")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message through the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="write --max-new-tokens tokens, past eos (for benchmarks and tests)")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16|float64")
    p.add_argument("--device", default="auto", help="cpu|cuda|auto")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 (per-channel) weights for the model's layers (CPU, bfloat16)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the decode step eager (no compiled program; engine.cpu.compiled)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="KV pool pages (default: fits context)")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory (speculative decoding; "
                   "default: the model's own drafter/ subdirectory, if it has one)")
    p.add_argument("--block-size", type=int, default=None,
                   help="speculative block size 2..16 (default: the drafter's)")
    p.add_argument("--no-draft", action="store_true",
                   help="plain decoding, even with --draft or a model that carries a drafter")
    p.add_argument("--speculation", choices=["auto", "always"], default="auto",
                   help="auto: verify the drafts that pay by step costs measured at start; "
                   "always: full blocks")
    p.add_argument("--trace", action="store_true", help="with --json: list every drafted block")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)


def _drafter_dir(args: argparse.Namespace, model_dir: Path) -> Path | None:
    """--no-draft: none; --draft DIR: DIR; otherwise the model's own drafter/, if any."""
    if args.no_draft:
        return None
    if args.draft:
        return Path(args.draft)
    return model_drafter_dir(model_dir)


def _chat_prompt(tokenizer, prompt: str) -> list[int]:
    """`prompt` as one user turn in the tokenizer's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _generate(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    if args.chat:
        if args.prompt is None:
            raise EngineError("--chat needs --prompt (the text of the user message)")
        if tokenizer is None:
            raise EngineError(f"{model_dir} has no tokenizer files: --chat needs one")
        if not getattr(tokenizer, "chat_template", None):
            raise EngineError(f"{model_dir}'s tokenizer has no chat template: drop --chat")
    elif args.prompt is not None and tokenizer is None:
        raise EngineError(f"{model_dir} has no tokenizer files: pass --prompt-ids instead")
    model = load_model(model_dir, dtype=dtype, device=device)
    draft_dir = _drafter_dir(args, model_dir)
    drafter = load_drafter(draft_dir, model) if draft_dir is not None else None
    if args.prompt is None:
        prompt = args.prompt_ids
    elif args.chat:
        prompt = _chat_prompt(tokenizer, args.prompt)
    else:
        prompt = tokenizer.encode(args.prompt)
    need = len(prompt) + args.max_new_tokens
    if drafter is not None and args.speculation == "auto":
        need = max(need, MEASURE_TOKENS)  # room to measure the step costs in
    pages = args.num_pages or -(-need // args.page_size) + 2
    detok = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
    engine = Engine(model, CacheConfig(args.page_size, pages), detokenize=detok, drafter=drafter,
                    spec=SpecConfig(args.block_size), speculation=args.speculation,
                    quantize=args.quantize, compile=False if args.no_compile else None)
    # The engine stops at the model's eos ids (generation_config.json's, else config.json's); a
    # chat reply also ends at the tokenizer's eos (the end-of-turn token, where those name
    # another one).
    end_of_turn: tuple[int, ...] = ()
    if args.chat and tokenizer.eos_token_id is not None:
        end_of_turn = (tokenizer.eos_token_id,)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), stop_token_ids=end_of_turn,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    (done,) = engine.generate([prompt], params, trace=args.trace)
    elapsed = time.perf_counter() - t0
    text_ids = done.output_ids
    if args.chat and done.finish_reason == "stop" and text_ids[-1:] and (
            text_ids[-1] in engine.eos_ids or text_ids[-1] in end_of_turn):
        text_ids = text_ids[:-1]  # the end-of-turn token is not part of the reply
    text = tokenizer.decode(text_ids) if tokenizer is not None else None
    if text is not None:
        for s in args.stop:
            text = text.split(s, 1)[0]
    if args.json:
        record = {
            "output_ids": done.output_ids,
            "text": text,
            "prompt_tokens": len(prompt),
            "finish_reason": done.finish_reason,
            "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(done.output_ids) / elapsed, 2),
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "model": str(model_dir),
            "fast_path": engine.fast_paths,
            "fast_path_s": round(engine.fast_path_s, 4),
            "fast_path_seconds": {k: round(v, 4) for k, v in engine.fast_path_seconds.items()},
        }
        if drafter is not None:
            c = done.counters
            record |= {
                "drafter": str(draft_dir),
                "block_size": engine.block_size,
                "acceptance_lengths": c.acceptance_lengths,
                "mean_acceptance_length": round(
                    sum(c.acceptance_lengths) / max(1, len(c.acceptance_lengths)), 3),
                "acceptance_histogram": c.acceptance_histogram,
                "accepted_per_position": c.accepted_per_position,
                "lookups": c.lookups, "lookup_tokens": c.lookup_tokens,
                "lookup_accepted": c.lookup_accepted,
            }
            if args.trace:
                record["drafts"] = c.drafts
        print(json.dumps(record))
    else:
        print(text if text is not None else " ".join(map(str, done.output_ids)))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a multi-turn agent task with real tools, timed with "
                       "and without speculation and KV reuse")
    p.add_argument("--model", default=None,
                   help=f"Hugging Face model directory (default: the embedded {EMBEDDED_MODEL})")
    p.add_argument("--no-draft", action="store_true", help="no speculative decoding")
    p.add_argument("--max-tokens", type=int, default=96, help="per model step")
    p.add_argument("--max-steps", type=int, default=3, help="model steps per user message")
    p.add_argument("--no-compare", action="store_true",
                   help="only the main run (skip the runs without speculation / KV reuse)")
    p.add_argument("--usd-per-hour", type=float, default=0.10,
                   help="assumed device price for the cost columns (default 0.10)")
    p.add_argument("--log", type=Path, help="also write the run log (JSONL) here, for "
                   "`agentflash report`")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    import anyio

    from .demo import demo
    from .runtime import Runtime

    from .usage import Pricing

    rt = Runtime.load(args.model, draft=False if args.no_draft else None,
                      pricing=Pricing(usd_per_hour=args.usd_per_hour), log=args.log)
    try:
        print(anyio.run(demo, rt, args.max_tokens, args.max_steps, not args.no_compare))
        if args.log is not None:
            print(f"run log: {args.log}  (agentflash report {args.log} -o report.html)")
    finally:
        rt.close()
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write a self-contained HTML dashboard from a run log")
    p.add_argument("log", type=Path, help="run log (JSONL) from Runtime(log=...) or demo --log")
    p.add_argument("-o", "--out", type=Path, default=Path("report.html"))
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    if not args.log.is_file():
        raise ValueError(f"no run log at {args.log}")
    print(f"wrote {write_report(args.log, args.out)}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API "
                       "(needs the server extra: pip install 'agentflash[server]')")
    p.add_argument("--model", default=None,
                   help=f"Hugging Face model directory (default: the embedded {EMBEDDED_MODEL})")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", type=Path, default=None,
                       help="DFlash drafter directory (default: the model's own drafter/)")
    draft.add_argument("--no-draft", action="store_true", help="no speculative decoding")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on /v1 (default: open)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="generation requests held at once; more get 429 (default 256)")
    p.add_argument("--no-compile", action="store_true",
                   help="eager forwards instead of the compiled CPU step")
    p.add_argument("--max-batch-tokens", type=int, default=SchedulerConfig.max_batch_tokens,
                   help="tokens per engine step, and where prompts are cut into prefill chunks "
                        "(default %(default)s)")
    p.add_argument("--prefill-first-steps", type=int,
                   default=SchedulerConfig.prefill_first_steps,
                   help="while prompts wait, up to this many steps in a row prefill them before "
                        "the running requests' next tokens; 0: decode in every step "
                        "(default %(default)s)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .server import create_app
    except ImportError as e:
        raise ValueError(f"agentflash serve needs the server extra ({e.name} is missing): "
                         "pip install 'agentflash[server]'") from None
    from .runtime import Runtime

    rt = Runtime.load(args.model, draft=False if args.no_draft else args.draft,
                      compile=False if args.no_compile else None,
                      scheduler=SchedulerConfig(
                          max_batch_tokens=args.max_batch_tokens,
                          prefill_first_steps=args.prefill_first_steps))
    try:
        app = create_app(rt, args.served_model_name, args.api_key, args.max_in_flight)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        rt.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_report(sub)
    _add_generate(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (EngineError, AgentflashError, ValueError) as e:
        print(f"agentflash: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
