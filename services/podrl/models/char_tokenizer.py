"""A character-level tokenizer built with `tokenizers`, saved in Hugging Face format.

Every printable ASCII character, newline and tab is one token; anything else maps to <unk>.
BPE with no merges over a per-character vocabulary gives exactly that, and the Fuse decoder
joins tokens back without spaces, so vLLM's incremental detokenizer and `transformers` agree.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = ["\n", "\t", *(chr(c) for c in range(32, 127))]

# A plain "role: content" transcript; the assistant turn is opened for generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
