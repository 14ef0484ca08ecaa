"""The command line: `generate` (JSON output, ids-only checkpoints, typed errors), `demo` (the
README's main job) and `report`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from agentflash.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentflash", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_json_with_prompt_ids_matches_transformers(hf_checkpoint):
    path, hf = hf_checkpoint("qwen3", bos_token_id=None, eos_token_id=None)
    proc = run_cli("generate", "--model", str(path), "--prompt-ids", "5,6,7,8",
                   "--max-new-tokens", "6", "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] is None  # the directory has no tokenizer
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                      min_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert out["output_ids"] == ref


def test_seeded_sampling_is_reproducible(hf_checkpoint, capsys):
    path, _ = hf_checkpoint("llama")
    args = ["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--temperature", "0.9",
            "--top-p", "0.95", "--top-k", "20", "--seed", "11", "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["output_ids"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == first


def test_errors_are_clear(hf_checkpoint, tmp_path, capsys):
    path, _ = hf_checkpoint("qwen3")
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "CheckpointError" in capsys.readouterr().err
    too_long = ",".join(["1"] * 600)  # the tiny config holds 512 positions
    assert main(["generate", "--model", str(path), "--prompt-ids", too_long]) == 2
    assert "ContextLengthError" in capsys.readouterr().err


@pytest.mark.parametrize("v2", [None, dict(conv_kernel_size=2, conv_group_size=16,
                                            selector_rank=4, selector_top_k=4)],
                         ids=["dflash", "dflash2"])
def test_generate_with_draft_reports_acceptance_and_trace(tmp_path, v2):
    from conftest import make_dflash_checkpoint, make_hf_model

    hf = make_hf_model("qwen3", vocab_size=16, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp_path / "t")
    make_dflash_checkpoint(tmp_path / "d", hf.config, block_size=4, v2=v2)
    common = ["generate", "--model", str(tmp_path / "t"), "--prompt-ids", "1,2,3,4,5",
              "--max-new-tokens", "20", "--json"]
    plain = run_cli(*common)
    spec = run_cli(*common, "--draft", str(tmp_path / "d"), "--trace", "--speculation", "always")
    auto = run_cli(*common, "--draft", str(tmp_path / "d"))  # the default
    forced_plain = run_cli(*common, "--draft", str(tmp_path / "d"), "--no-draft")
    assert plain.returncode == spec.returncode == forced_plain.returncode == 0, spec.stderr
    assert auto.returncode == 0, auto.stderr
    p, s, f, a = (json.loads(x.stdout) for x in (plain, spec, forced_plain, auto))
    assert s["output_ids"] == p["output_ids"] == f["output_ids"] == a["output_ids"]
    assert sum(s["acceptance_lengths"]) == len(s["output_ids"]) - 1
    assert len(s["drafts"]) == len(s["acceptance_lengths"])
    assert all(1 <= len(d) <= 3 for d in s["drafts"]) and len(s["drafts"][0]) == 3
    assert "acceptance_lengths" not in f
    bad = run_cli(*common, "--draft", str(tmp_path / "d"), "--block-size", "40")
    assert bad.returncode == 2 and "block_size" in bad.stderr


def test_demo_writes_a_log_that_report_renders(tmp_path):
    log, html = tmp_path / "run.jsonl", tmp_path / "report.html"
    proc = run_cli("demo", "--no-compare", "--max-tokens", "24", "--max-steps", "2",
                   "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    assert {int(r[:4]) for r in rows} == {1, 2, 3, 4, 5}   # every user turn of the task ran
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == len(rows)
    # turn N reuses the session: only its new tokens are computed
    later = steps[-1]["usage"]
    assert later["prompt_tokens_details"]["cached_tokens"] > later["prompt_tokens"] // 2
    proc = run_cli("report", str(log), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    assert "<svg" in html.read_text()
    proc = run_cli("report", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "no run log" in proc.stderr
