"""agentrl's reader of Kimi's tiktoken files gives the released TikTokenTokenizer's ids without running its code.

The reference below is the released tokenizer's encoding procedure (tokenization_kimi.py: its split pattern, its
special tokens named from added_tokens_decoder, its 400,000-character slicing and 25,000-character run splitting),
written out here on tiktoken directly; the pattern is spelled out again rather than imported, so a slip in agentrl's
copy shows."""

from __future__ import annotations

import json
import os

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from agentrl.chat import KimiTokenizer
from agentrl.chat.tokenizers import read_tiktoken_ranks

RELEASED_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

CORPUS = [
    "Hello, World! It's a test; we'll see what they've done.", "HTTPServer parseJSON iPhone McDonald's",
    "数学计算器：求平均值。混合English与中文，再加数字12345。", "日本語のテキストとカタカナ", "مرحبا بالعالم", "Ünïcödé Ωμέγα ∑∫√",
    "0 12 345 6789 1234567890 3.14159 -42 1e-9 0x1F", "def f(x):\n    return {'a': [1, 2]}  # comment\n\n\tpass\r\n",
    "<|im_end|><|im_user|>user<|im_middle|> [BOS] <|tool_call_begin|>functions.x:0<|tool_call_end|> <|reserved_token_900|>",
    "emoji 😀👍🏽 and zero-width\u200bjoiner", " " * 30_000 + "x" * 26_000 + "\n" * 3, "ab " * 140_000,
]


def released_specials(directory: str, num_base: int) -> dict[str, int]:
    config = json.load(open(os.path.join(directory, "tokenizer_config.json")))
    names = {int(i): v["content"] for i, v in config["added_tokens_decoder"].items()}
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, num_base + 256 + 2)}


def released_slices(s: str, limit: int):
    """The released `_split_whitespaces_or_nonwhitespaces`."""
    current_len, current_is_space, start = 0, s[0].isspace() if s else False, 0
    for i in range(len(s)):
        now_space = s[i].isspace()
        if current_is_space ^ now_space:
            current_len, current_is_space = 1, now_space
        else:
            current_len += 1
            if current_len > limit:
                yield s[start:i]
                start, current_len = i, 1
    yield s[start:]


def released_encode(encoding, text: str, allow_special: bool) -> list[int]:
    out = []
    for i in range(0, len(text), 400_000):
        for piece in released_slices(text[i:i + 400_000], 25_000):
            out += (encoding.encode(piece, allowed_special="all") if allow_special
                    else encoding.encode(piece, disallowed_special=()))
    return out


@pytest.fixture(scope="module")
def released(tokenizer_dirs):
    directory = tokenizer_dirs["kimi"]
    ranks = load_tiktoken_bpe(os.path.join(directory, "tiktoken.model"))
    encoding = tiktoken.Encoding(name="tiktoken.model", pat_str=RELEASED_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=released_specials(directory, len(ranks)))
    return directory, encoding


def test_the_ranks_read_as_tiktoken_reads_them(released):
    directory, encoding = released
    assert read_tiktoken_ranks(os.path.join(directory, "tiktoken.model")) == \
           load_tiktoken_bpe(os.path.join(directory, "tiktoken.model"))


@pytest.mark.parametrize("allow_special", [True, False], ids=["encode", "content"])
def test_ids_equal_the_released_tokenizers_on_a_mixed_corpus(released, allow_special):
    directory, encoding = released
    ours = KimiTokenizer.from_directory(directory)
    assert ours.special_tokens == encoding._special_tokens
    for text in CORPUS:
        expected = released_encode(encoding, text, allow_special)
        got = ours.encode(text) if allow_special else ours.encode_text(text)
        assert got == expected, text[:60]
        assert ours.decode(got) == text


def test_marker_strings_become_control_ids_only_when_allowed(released):
    directory, _ = released
    ours = KimiTokenizer.from_directory(directory)
    end = ours.token_id("<|im_end|>")
    assert end in ours.encode("a<|im_end|>b") and end not in ours.encode_text("a<|im_end|>b")
    assert ours.token_id("<|reserved_token_5|>") is None and ours.token_id(f"<|reserved_token_{end + 3}|>")


def test_the_checkpoints_own_tokenizer_code_is_never_run(released, tmp_path):
    """A Kimi checkpoint ships tokenization_kimi.py (remote code that does not import under the pinned
    transformers): agentrl loads the tokenizer from its data files alone."""
    import shutil

    directory, _ = released
    shutil.copytree(directory, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenization_kimi.py").write_text("raise RuntimeError('remote code was executed')\n")
    config = json.load(open(tmp_path / "ckpt" / "tokenizer_config.json"))
    config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(config))
    from agentrl.chat import load_chat_format

    assert load_chat_format(str(tmp_path / "ckpt")).name == "kimi"
