"""Random-weight Qwen3 checkpoints for benchmarks (standard Hugging Face directories).

    python tools/make_random_model.py --preset 30m --out /tmp/bench30m            # seed 0
    python tools/make_random_model.py --preset 5m --seed 1 --out /tmp/bench6m
    python tools/make_random_model.py --preset 0.6b --out /tmp/qwen3-0.6b-shaped   # bf16, 1.2 GB
"""

from __future__ import annotations

import argparse

import torch

PRESETS = {
    # ~30M parameters: the size class of the embedded default model
    "30m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                max_position_embeddings=16384, tie_word_embeddings=True),
    # ~5M parameters: small enough to train a drafter for it in minutes on a CPU
    "5m": dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=4096, tie_word_embeddings=True),
    # Qwen3-0.6B's shape (0.6B parameters, saved in bfloat16 as the published checkpoint is)
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                 tie_word_embeddings=True, torch_dtype="bfloat16"),
}


def make_random_checkpoint(path: str, preset: str = "30m", seed: int = 0) -> str:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**PRESETS[preset])
    model = transformers.Qwen3ForCausalLM(config)
    if PRESETS[preset].get("torch_dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="30m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(make_random_checkpoint(args.out, args.preset, args.seed))


if __name__ == "__main__":
    main()
