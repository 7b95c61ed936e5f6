"""Stop strings that a single token stands for become stop tokens (vLLM then skips its
detokenizer; the text is decoded once): which strings qualify. No engine."""

from __future__ import annotations

from pathlib import Path

from podrl.generator.generation import lone_character_tokens, stop_tokens_for
from podrl.models.tiny import make_tiny_model


class _Vocabulary:
    """A tokenizer's surface as ``lone_character_tokens`` reads it."""

    def __init__(self, texts: list[str], special: tuple[int, ...] = ()):
        self._texts = texts
        self.all_special_ids = list(special)

    def __len__(self) -> int:
        return len(self._texts)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._texts[i] for i in ids)


def test_a_character_qualifies_only_when_one_token_holds_it_and_is_it() -> None:
    vocab = _Vocabulary(["<eos>", "\n", "a", "ab", "b\n", "é", "c", "x", "yz"], special=(0,))
    # "\n" also ends "b\n" (a stop token would miss it there); "a" and "b" are in "ab"; "y"
    # and "z" only come as "yz"; "é" is not ASCII; the special token's letters never show.
    assert lone_character_tokens(vocab) == {"c": 6, "x": 7}


def test_the_tiny_tokenizer_stops_on_a_newline_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = tmp_path / "tiny"
    make_tiny_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lone = lone_character_tokens(tokenizer)
    assert lone["\n"] == tokenizer.encode("\n")[0]
    assert lone["e"] == tokenizer.encode("e")[0]  # "<eos>" is special: it never shows as text


def test_stop_strings_map_to_tokens_only_when_every_one_qualifies() -> None:
    lone = {"\n": 4, ";": 9}
    assert stop_tokens_for(["\n"], lone) == [4]
    assert stop_tokens_for([";", "\n", ";"], lone) == [4, 9]
    assert stop_tokens_for(["\n", "\n\n"], lone) is None  # vLLM's detokenizer checks them
    assert stop_tokens_for(["x"], lone) is None
    assert stop_tokens_for([], lone) is None
