"""The shipped embedded checkpoints: tokenizer and chat template, target, drafter.

Held-out prompts come from tests/data/heldout.jsonl: conversations of the corpus's test split
(tools/build_corpus.py), never trained on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.cpu import fastpath
from agentflash.engine.config import CacheConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.cpu.quantized import Int8Linear
from agentflash.engine.sampler import SamplingParams
from agentflash.tokenizer import load_tokenizer
from agentflash.engine.cpu.forward import ModuleDraftForward
from agentflash.engine.models.dflash_config import DFlash2Extras
from agentflash.kernels import cpu_ops
from agentflash.training.drafter_checkpoint import grow_to_v2, init_drafter
from skips import CPU_KERNELS, PREFILL_THROUGH_KERNELS, ROW_INVARIANT_BF16

HELDOUT = Path(__file__).parent / "data" / "heldout.jsonl"
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def target():
    return load_model(embedded_model_dir(), dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter(target):
    return load_drafter(model_drafter_dir(embedded_model_dir()), target)


def conversations() -> list[dict]:
    return [json.loads(line) for line in HELDOUT.read_text().splitlines()]


def prompt_ids(tokenizer, conv: dict) -> list[int]:
    """The conversation up to its last assistant turn, ready for the model to answer."""
    last = max(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
    text = tokenizer.apply_chat_template(conv["messages"][:last], tools=conv["tools"] or None,
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_checkpoint_layout_and_special_tokens(tokenizer, target, drafter):
    assert model_drafter_dir(embedded_model_dir()) is not None
    assert target.config.vocab_size == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end
    # generation ends at the end of the turn and at the end of a document
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert set(target.config.eos_token_ids) == {im_end, end_of_text}
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert drafter.config.block_size == 16
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize("conv", conversations(), ids=lambda c: c["id"])
def test_chat_template_round_trips_tool_calls(tokenizer, conv):
    text = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"] or None,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level: lossless, tool tags kept
    calls = [tc["function"] for m in conv["messages"] for tc in m.get("tool_calls") or []]
    turns = text.split("<|im_end|>", 1)[1] if conv["tools"] else text  # past the tool list
    parsed = [json.loads(block) for block in TOOL_CALL.findall(turns)]
    assert parsed == [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    for tool in conv["tools"]:
        assert json.dumps(tool, ensure_ascii=False) in text
    results = [m["content"] for m in conv["messages"] if m["role"] == "tool"]
    for r in results:
        assert f"<tool_response>\n{r}\n</tool_response>" in text


def test_transformers_loads_the_target_and_agrees(tokenizer, target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir()), dtype=torch.float32)
    ids = prompt_ids(tokenizer, conversations()[0])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    (done,) = Engine(target).generate([ids], SamplingParams(max_new_tokens=1))
    assert done.output_ids == [int(want.argmax())]


def run(engine: Engine, prompts: list[list[int]], n: int):
    return engine.generate(prompts, SamplingParams(max_new_tokens=n))


def mean_tau(done) -> float:
    taus = [t for c in done for t in c.counters.acceptance_lengths]
    return sum(taus) / len(taus)


def test_dflash_greedy_equals_plain_and_beats_a_random_drafter(tokenizer, target, drafter):
    prompts = [prompt_ids(tokenizer, c) for c in conversations()]
    plain = run(Engine(target), prompts, 48)
    spec = run(Engine(target, drafter=drafter, spec=SpecConfig(16),
                      speculation="always"), prompts, 48)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    c = drafter.config
    fresh = init_drafter(target.config, 16, c.num_hidden_layers, list(c.target_layer_ids),
                         c.mask_token_id, seed=0)
    rand = run(Engine(target, drafter=fresh, spec=SpecConfig(16),
                      speculation="always"), prompts, 48)
    assert [c.output_ids for c in rand] == [c.output_ids for c in plain]
    trained, random_tau = mean_tau(spec), mean_tau(rand)
    print(f"mean tau: trained {trained:.2f}, random {random_tau:.2f}")
    # A random drafter's guesses are essentially never accepted; the shipped one's are, often
    # (docs/embedded-model.md: mean tau 3.6 on the test split; the goal of 4 is not met yet).
    assert random_tau < 1.05
    assert trained > random_tau + 0.3, (trained, random_tau)


def test_a_dflash2_drafter_on_the_bfloat16_fast_path_equals_plain(tokenizer, target):
    """A DFlash2 drafter grown from the shipped one (its convolutions the identity) on the
    bfloat16 fast path (its module forward on the CPU kernels' attention, int8 linears, where
    they run): greedy output is plain output, and its drafts are accepted."""
    fresh = load_drafter(model_drafter_dir(embedded_model_dir()), target, dtype=torch.float32)
    v2 = grow_to_v2(fresh, DFlash2Extras(conv_kernel_size=4, conv_group_size=64,
                                         selector_rank=64, selector_top_k=8))
    target = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    prompts = [prompt_ids(tokenizer, c) for c in conversations()][:4]
    plain = run(Engine(target, compile=False), prompts, 48)
    engine = Engine(target, drafter=v2.to(torch.bfloat16), spec=SpecConfig(16),
                    speculation="always", compile=False)
    spec = run(engine, prompts, 48)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert mean_tau(spec) > 1.5
    if cpu_ops.available():
        assert isinstance(engine.runner.drafter.forward, ModuleDraftForward)


@ROW_INVARIANT_BF16.mark
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_dflash_greedy_equals_plain_in_bfloat16(tokenizer, compile):
    """bfloat16 is the CPU default where bf16 is native; its decode/verify attention is
    row-invariant (kernels.torch_ops._chunked_attention), so outputs match to the bit: with
    full blocks, shorter ones, and "auto", which mixes verify lengths and plain steps; eager and
    through the compiled step (engine.cpu.compiled), the prompts batched together so that decode
    rows, verify blocks and prefill chunks share steps."""
    target = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), target)
    prompts = [prompt_ids(tokenizer, c) for c in conversations()]
    plain_engine = Engine(target, compile=compile)
    assert ("aoti-compiled-step" in plain_engine.fast_paths) == compile
    plain = [c.output_ids for c in run(plain_engine, prompts, 96)]
    auto = Engine(target, drafter=drafter, spec=SpecConfig(16), compile=compile)
    assert auto.policy.auto  # the default: step costs measured at load
    for engine in (Engine(target, drafter=drafter, spec=SpecConfig(16), compile=compile,
                          speculation="always"),
                   Engine(target, drafter=drafter, spec=SpecConfig(5), compile=compile,
                          speculation="always"), auto):
        assert [c.output_ids for c in run(engine, prompts, 96)] == plain


@PREFILL_THROUGH_KERNELS.mark
def test_a_prompts_output_is_the_same_alone_and_batched(tokenizer):
    """Where the compiled decode forward takes prefill chunks too (AMX, AVX512-BF16, AVX2:
    DecodeForward.takes_prefill), every row is computed by itself whatever shares its forward,
    so a prompt's greedy output is the same alone as batched with others, a prefix another
    prompt computed (in a chunk of another length) included. (Elsewhere a chunk runs on oneDNN
    in a forward of its own, but a remainder of 32 tokens or fewer after a reused prefix goes
    through the program, whose numbers are not oneDNN's, so a reply can differ.)"""
    target = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), target)
    prompts = [prompt_ids(tokenizer, c) for c in conversations()]
    for engine in (Engine(target, compile=True),
                   Engine(target, drafter=drafter, spec=SpecConfig(16), compile=True)):
        assert engine.runner.decode.takes_prefill
        batched = [c.output_ids for c in run(engine, prompts, 64)]
        assert [run(engine, [p], 64)[0].output_ids for p in prompts] == batched
        engine.clear_cache()
        assert [run(engine, [p], 64)[0].output_ids for p in reversed(prompts)] == batched[::-1]


@CPU_KERNELS.mark
def test_the_int8_drafter_is_accepted_as_often_as_the_bf16_one(tokenizer, monkeypatch):
    """Where the CPU kernels run, a bfloat16 target's drafter is int8 by default
    (engine.cpu.fastpath's int8-drafter), except on AMX tiles, whose bfloat16 linears are the
    faster: it changes which drafts are proposed, never the output, and on the held-out prompts
    its drafts are accepted about as often as the bfloat16 drafter's (measured: mean tau 5.27
    against 5.17)."""
    target = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    default = fastpath._drafts_int8(target, load_drafter(
        model_drafter_dir(embedded_model_dir()), target), None)
    assert default == (not cpu_ops.tile_linears())
    prompts = [prompt_ids(tokenizer, c) for c in conversations()]
    plain = [c.output_ids for c in run(Engine(target, compile=False), prompts, 48)]
    taus = {}
    for int8 in (True, False):
        # the same engine with and without the transformation, whatever this CPU's default
        monkeypatch.setattr(cpu_ops, "tile_linears", lambda: not int8)
        drafter = load_drafter(model_drafter_dir(embedded_model_dir()), target)
        engine = Engine(target, drafter=drafter, spec=SpecConfig(16), compile=False,
                        speculation="always")
        assert ("int8-drafter" in engine.fast_paths) == int8
        assert isinstance(drafter.layers[0].mlp.gate_up_proj, Int8Linear) == int8
        assert isinstance(drafter.head, Int8Linear) == int8  # a copy of the target's head
        done = run(engine, prompts, 48)
        assert [c.output_ids for c in done] == plain
        taus[int8] = mean_tau(done)
    print(f"mean tau: int8 drafter {taus[True]:.2f}, bf16 drafter {taus[False]:.2f}")
    assert taus[True] >= 0.9 * taus[False], taus


def test_turn_two_reuses_the_cached_conversation(tokenizer, target, drafter):
    conv = conversations()[3]  # multi-turn, with tool results
    engine = Engine(target, CacheConfig(16, 512), drafter=drafter, spec=SpecConfig(16),
                    speculation="always")
    first = prompt_ids(tokenizer, {**conv, "messages": conv["messages"][:2]})
    (a,) = engine.generate([first], SamplingParams(max_new_tokens=16))
    second = prompt_ids(tokenizer, conv)
    assert second[:len(first)] == first
    (b,) = engine.generate([second], SamplingParams(max_new_tokens=16))
    assert b.counters.cached_tokens >= len(first) // 16 * 16
    assert b.counters.cached_tokens + b.counters.prefill_tokens == len(second)
