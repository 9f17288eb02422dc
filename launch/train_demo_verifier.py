"""Train the demo verifier: a small real Qwen3 model with its own tokenizer.

Everything is built offline from the demo conversations (``launch.demo_corpus``):

1. a byte-level BPE tokenizer (``tokenizers``) trained on the conversation texts,
   with ChatML special tokens, a DSpark mask token and a chat template (stored in
   ``tokenizer_config.json``) for system/user/assistant/tool roles;
2. a ``Qwen3ForCausalLM`` (4 layers, hidden 192, ~3.3M parameters, untied
   ``lm_head``) trained as a plain language model on the chat-rendered
   conversations, fp32 on CPU, then saved in bf16 (HF folder: ``config.json``,
   ``model.safetensors``, tokenizer files) together with ``training_log.json``.

    nice -n 10 python -m launch.train_demo_verifier \\
        --data configs/demo/conversations.jsonl \\
        --heldout configs/demo/conversations_heldout.jsonl \\
        --out configs/demo/verifier

Seeded end to end; with the same data, torch version and thread count the
weights reproduce bit for bit. At most ``--threads`` (default 2) torch threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, MASK_TOKEN = (
    SPECIAL_TOKENS[0],
    SPECIAL_TOKENS[1],
    SPECIAL_TOKENS[2],
    SPECIAL_TOKENS[3],
)

# ChatML, as Qwen models use it. Text-only content; tools are listed in a
# leading system block; assistant reasoning goes in <think> and tool calls in
# <tool_call> blocks. Prefix-stable: rendering conv[:j] with the generation
# prompt gives a prefix of rendering conv[:j+1] when turn j is the assistant's.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is none -%}"
    "{%- else -%}{%- for p in c -%}"
    "{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{ text(messages[0].content) + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n' }}{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (tools and loop.first and m.role == 'system') -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ text(m.content) }}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{{ '\\n<tool_call>\\n' }}"
    "{{ (tc.function if tc.function is defined else tc) | tojson }}{{ '\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Verifier geometry: ~3.3M parameters (1.6M of them embedding + lm_head).
MODEL_CONFIG = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,  # 4 x 64 = 256 != hidden_size, as in Qwen3-0.6B
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
)


def read_conversations(path: str | Path) -> list[list[dict]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["conversations"] for line in fh if line.strip()]


def train_tokenizer(conversations: list[list[dict]], vocab_size: int):
    """Byte-level BPE on the role names and message texts, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for conv in conversations:
            for turn in conv:
                yield turn["role"] + "\n"
                yield turn["content"]

    tok.train_from_iterator(texts(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[BOS_TOKEN],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class and extra special tokens so that transformers 4.x
    (as a vLLM environment may have) loads the folder as well as 5.x does."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if extra:
        cfg["additional_special_tokens"] = list(extra)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def render_ids(tokenizer, conversation: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def build_model_config(tokenizer):
    from transformers import Qwen3Config

    cfg = dict(MODEL_CONFIG)
    rope_theta = cfg.pop("rope_theta")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        **cfg,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def evaluate(model, stream, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross entropy (nats) over consecutive windows of ``stream``."""
    import torch

    n = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in range(0, n, 8):
            idx = torch.arange(b, min(n, b + 8)) * seq_len
            x = torch.stack([stream[i : i + seq_len] for i in idx.tolist()])
            y = torch.stack([stream[i + 1 : i + seq_len + 1] for i in idx.tolist()])
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += y.numel()
    model.train()
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="configs/demo/conversations.jsonl")
    ap.add_argument("--heldout", default="configs/demo/conversations_heldout.jsonl")
    ap.add_argument("--out", default="configs/demo/verifier")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    t0 = time.time()
    train_convs = read_conversations(args.data)
    held_convs = read_conversations(args.heldout) if args.heldout else []
    tokenizer = train_tokenizer(train_convs, args.vocab_size)
    print(f"tokenizer: {len(tokenizer)} tokens ({time.time() - t0:.1f}s)", flush=True)

    eot = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    def stream_of(convs):
        ids: list[int] = []
        for conv in convs:
            ids.extend(render_ids(tokenizer, conv))
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.long)

    train_stream = stream_of(train_convs)
    held_stream = stream_of(held_convs) if held_convs else None
    n_chars = sum(len(t["content"]) for c in train_convs for t in c)
    print(
        f"train stream: {len(train_stream)} tokens ({n_chars / len(train_stream):.2f} chars/token)",
        flush=True,
    )

    config = build_model_config(tokenizer)
    model = Qwen3ForCausalLM(config)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    max_start = len(train_stream) - args.seq_len - 1
    log = []
    t_train = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, max_start, (args.batch_size,), generator=gen)
        x = torch.stack([train_stream[s : s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([train_stream[s + 1 : s + args.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            tps = (step + 1) * args.batch_size * args.seq_len / el
            print(
                f"step {step:5d} loss {loss.item():.4f} lr {lr_at(step):.2e} "
                f"{tps:.0f} tok/s {el:.0f}s",
                flush=True,
            )
            log.append({"step": step, "loss": round(loss.item(), 5)})
    train_seconds = time.time() - t_train

    train_loss = evaluate(model, train_stream, args.seq_len)
    held_loss = evaluate(model, held_stream, args.seq_len) if held_stream is not None else None
    print(
        f"eval: train ce {train_loss:.4f} (ppl {math.exp(train_loss):.2f})"
        + (f", held-out ce {held_loss:.4f} (ppl {math.exp(held_loss):.2f})" if held_loss else ""),
        flush=True,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_dtype = getattr(torch, args.save_dtype)
    model.to(save_dtype)
    model.config.dtype = args.save_dtype
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    portable_tokenizer_config(out / "tokenizer_config.json")

    # held-out loss again with the saved (bf16) weights, as extraction will see them
    held_loss_saved = (
        evaluate(model, held_stream, args.seq_len) if held_stream is not None else None
    )
    weights_sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    record = {
        "command": " ".join(["python -m launch.train_demo_verifier", *(argv or sys.argv[1:])]),
        "torch": torch.__version__,
        "threads": args.threads,
        "seed": args.seed,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "train_tokens_in_stream": len(train_stream),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "train_ce_fp32": round(train_loss, 4),
        "heldout_ce_fp32": round(held_loss, 4) if held_loss is not None else None,
        "heldout_ce_saved": round(held_loss_saved, 4) if held_loss_saved is not None else None,
        "heldout_ppl_saved": round(math.exp(held_loss_saved), 3) if held_loss_saved else None,
        "save_dtype": args.save_dtype,
        "model_safetensors_sha256": weights_sha,
        "loss_curve": log,
    }
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out} ({time.time() - t0:.0f}s total)", flush=True)


if __name__ == "__main__":
    main()
