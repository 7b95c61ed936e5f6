"""Stop strings that a single token stands for become stop tokens (vLLM then skips its
detokenizer; the text is decoded once): which strings qualify. No engine."""

from __future__ import annotations

from pathlib import Path

from podrl.config.generator import GeneratorConfig
from podrl.generator.engine import VllmEngine, _lone_character_tokens
from podrl.models.tiny import make_tiny_model


class _Vocabulary:
    """A tokenizer's surface as ``_lone_character_tokens`` reads it."""

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
    assert _lone_character_tokens(vocab) == {"c": 6, "x": 7}


def test_the_tiny_tokenizer_stops_on_a_newline_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = tmp_path / "tiny"
    make_tiny_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lone = _lone_character_tokens(tokenizer)
    assert lone["\n"] == tokenizer.encode("\n")[0]
    assert lone["e"] == tokenizer.encode("e")[0]  # "<eos>" is special: it never shows as text


def test_stop_strings_map_to_tokens_only_when_every_one_qualifies() -> None:
    engine = VllmEngine(GeneratorConfig(), Path("unused"), trusted_publisher_id="t")
    engine._lone_tokens = {"\n": 4, ";": 9}
    assert engine._stop_token_ids(["\n"]) == [4]
    assert engine._stop_token_ids([";", "\n", ";"]) == [4, 9]
    assert engine._stop_token_ids(["\n", "\n\n"]) is None  # vLLM's detokenizer checks them
    assert engine._stop_token_ids(["x"]) is None
    assert engine._stop_token_ids([]) is None
