"""A tiny character-level tokenizer with a chat template, built locally (no download), for the tiny test backbones.

One token per lower-cased character, so a prompt's token count is easy to predict in tests. Ids match conftest.TINY:
<pad>=0, <s>=1, </s>=2 (eos, ends every chat turn), <unk>=3; vocabulary size <= 96 (the tiny models' vocabulary).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = string.ascii_lowercase + string.digits + " .,;:!?'\"-()\n"
# <s>, then each turn as <|role|>content</s>, then <|assistant|> when a reply is wanted.
CHAT_TEMPLATE = ("{{ '<s>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def tiny_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs {len(vocab)} ids but the model's vocabulary is {vocab_size}")
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>",
                                        additional_special_tokens=SPECIAL[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
