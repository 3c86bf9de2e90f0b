"""Create a tiny random Llama-style model and a locally trained tokenizer (no downloads).

Run with the vLLM environment's Python (it has ``transformers`` and ``tokenizers``)::

    .venv-vllm/bin/python tests/engines/make_tiny_model.py OUT_DIR

The model is about 0.85 M parameters by default (hidden size 128, 2 layers, 2 heads of 64;
``--hidden``/``--layers`` make larger ones for benchmarks), random weights from a fixed seed;
the tokenizer is a byte-level BPE trained on generated text, saved as a
``PreTrainedTokenizerFast`` with a small chat template. Output is deterministic for a given
seed, so two engines started from the same directory agree on every token. With
``--lora-of MODEL_DIR`` it writes a random LoRA adapter of that model to ``OUT_DIR``
instead.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>", "<|end|>"]
VOCAB_SIZE = 512

WORDS_TEXT = (
    "the a an of to in on for with about system user assistant tool call result please "
    "explain write code function data model cache prefix token request route engine fast "
    "slow queue batch time memory block hash replica tenant share agent turn reply answer "
    "question document summary list plan step check test value number zero one two three"
)
WORDS = WORDS_TEXT.split(" ")


def corpus(seed: int, lines: int) -> list[str]:
    """Generated training text: random word sequences with digits and punctuation."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 20))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def make_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(seed, 4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja only; gateways that read
    # tokenizer_config.json (the older place) find it there too.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))


def make_model(
    out: Path,
    seed: int,
    hidden: int = 128,
    layers: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
) -> None:
    """Random Llama weights: heads of 64, as many as ``hidden`` holds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 64:
        raise SystemExit(f"--hidden must be a multiple of 64, got {hidden}")
    heads = hidden // 64
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def make_lora_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8) -> None:
    """A random LoRA adapter of the model in ``model_dir`` (its attention's query and value
    projections), written as PEFT writes one, which vLLM loads with ``--lora-modules``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, width in (("q_proj", hidden), ("v_proj", kv_width)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(rank, hidden, generator=generator) * 0.02
            b = torch.randn(width, rank, generator=generator) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lora-of", type=Path, default=None, help="write a LoRA adapter of this model instead"
    )
    # Larger shapes for benchmarks where prefill should dominate a CPU engine's time.
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (2x hidden)")
    parser.add_argument("--max-positions", type=int, default=2048, help="context length")
    args = parser.parse_args()
    if args.lora_of is not None:
        make_lora_adapter(args.lora_of, args.out, args.seed)
        print(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(args.out, args.seed)
    make_model(args.out, args.seed, args.hidden, args.layers, args.intermediate, args.max_positions)
    print(args.out)


if __name__ == "__main__":
    main()
