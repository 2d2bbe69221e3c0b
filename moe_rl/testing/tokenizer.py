"""A real HF tokenizer for the tiny test checkpoints, built offline with the `tokenizers` library.

One token per printable ASCII character and newline (a BPE model without merges: every character is a
token), the special tokens <pad> <s> </s> <unk> of the tiny configs' ids 0-3, and ChatML's <|im_start|> and
<|im_end|> with a ChatML chat template, so `text` prompts, /tokenize and the OpenAI chat endpoints run
against a tiny model. 104 ids: fits the tiny models' 128-token vocabulary.
"""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tiny_tokenizer(model_dir: str | Path) -> Path:
    """Write the tokenizer (tokenizer.json, its config with the chat template) into `model_dir`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(model_dir))
    return Path(model_dir)
