"""IncrementalDetokenizer: streamed deltas against `tokenizer.decode` of the same ids."""

import pytest

from tests.tiny_tokenizer import tiny_tokenizer_files
from tinyserve.frontend.detokenizer import IncrementalDetokenizer
from tinyserve.models.tokenizer import IM_END_TOKEN, IM_START_TOKEN, load_tokenizer

PROMPT = "The Zen of Python says:"
TEXT = " Beautiful is better than ugly. Explicit is better than implicit.\n\nSimple is better than complex."
UNICODE_TEXT = " 日本語のテキスト 🤖🎉 naïve café — ünïcödé"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_files(tmp_path_factory.mktemp("tokenizer")))


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_size: int = 1) -> list[str]:
    """Feed ids as the engine would, `chunk_size` at a time; the last call says finished."""
    chunks = [token_ids[i : i + chunk_size] for i in range(0, len(token_ids), chunk_size)]
    return [detokenizer.update(chunk, finished=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_deltas_concatenate_to_the_decoded_output(tokenizer, chunk_size):
    output_ids = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    deltas = stream(detokenizer, output_ids, chunk_size)
    assert "".join(deltas) == tokenizer.decode(output_ids) == TEXT
    assert detokenizer.output_text == TEXT
    assert detokenizer.stop_reason is None


def test_characters_split_across_tokens_are_never_streamed_in_halves(tokenizer):
    output_ids = tokenizer.encode(UNICODE_TEXT)
    # The test means something only if some token is a fragment of a character.
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in output_ids)
    deltas = stream(IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT)), output_ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(output_ids) == UNICODE_TEXT


def test_an_unfinished_character_at_the_end_decodes_as_replacement_character(tokenizer):
    emoji_ids = tokenizer.encode("🤖")
    assert len(emoji_ids) > 1
    output_ids = tokenizer.encode(" robot ") + emoji_ids[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed_before_end = detokenizer.update(output_ids)
    assert "\ufffd" not in streamed_before_end
    final = detokenizer.update([], finished=True)
    assert streamed_before_end + final == tokenizer.decode(output_ids)
    assert final.endswith("\ufffd")


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    emoji_ids = tokenizer.encode("🤖")
    prompt_ids = tokenizer.encode(PROMPT) + emoji_ids[:1]
    output_ids = emoji_ids[1:] + tokenizer.encode(" done")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids)
    assert "".join(deltas) == tokenizer.decode(output_ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept_as_decode_does(tokenizer, skip_special_tokens):
    output_ids = tokenizer.encode(f"Simple.{IM_END_TOKEN}{IM_START_TOKEN}user\nWhy?{IM_END_TOKEN}")
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    text = "".join(stream(detokenizer, output_ids))
    assert text == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert (IM_END_TOKEN in text) is not skip_special_tokens


def stop_string_across_a_token_boundary(tokenizer, text: str) -> str:
    """Five characters of `text` that begin two characters before a boundary between
    tokens (a few tokens in), and appear there for the first time."""
    ids = tokenizer.encode(text)
    for num_tokens in range(3, len(ids)):
        boundary = len(tokenizer.decode(ids[:num_tokens]))
        candidate = text[boundary - 2 : boundary + 3]
        if text.find(candidate) == boundary - 2:
            return candidate
    raise AssertionError("the text has no usable token boundary")


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    stop = stop_string_across_a_token_boundary(tokenizer, TEXT)
    output_ids = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), stop=["never appears", stop])
    deltas = [detokenizer.update([token_id]) for token_id in output_ids]
    expected = TEXT[: TEXT.index(stop)]
    # Text once streamed is never taken back, so no delta can hold part of the stop string.
    assert "".join(deltas) == expected == detokenizer.output_text
    assert detokenizer.stop_reason == stop
    assert detokenizer.update(tokenizer.encode(" more"), finished=True) == ""
    assert detokenizer.output_text == expected


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    stop = stop_string_across_a_token_boundary(tokenizer, TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=True)
    deltas = [detokenizer.update([token_id]) for token_id in tokenizer.encode(TEXT)]
    assert "".join(deltas) == TEXT[: TEXT.index(stop) + len(stop)]
    assert detokenizer.stop_reason == stop


def test_of_stop_strings_found_together_the_one_starting_first_wins(tokenizer):
    # Both end with the same character, so the same token completes them.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["ly.", "ugly."])
    text = "".join(stream(detokenizer, tokenizer.encode(TEXT)))
    assert text == TEXT[: TEXT.index("ugly.")]
    assert detokenizer.stop_reason == "ugly."


def test_stop_strings_are_looked_for_only_after_min_tokens(tokenizer):
    output_ids = tokenizer.encode(TEXT)
    first = TEXT.index("better")
    second = TEXT.index("better", first + 1)
    tokens_through_first = next(n for n in range(len(output_ids))
                                if len(tokenizer.decode(output_ids[:n])) >= first + len("better"))
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["better"], min_tokens=tokens_through_first)
    text = "".join(stream(detokenizer, output_ids))
    # The first "better" ends within the first min_tokens tokens: only the second one stops.
    assert text == TEXT[:second]
    assert detokenizer.stop_reason == "better"


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_the_stop_token_that_ended_a_request_is_not_in_its_text(tokenizer, include_stop_str_in_output):
    # The engine stopped on the last id, a stop_token_ids token with ordinary text.
    ids = tokenizer.encode(" Simple is better.")
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                         include_stop_str_in_output=include_stop_str_in_output)
    text = detokenizer.update(ids[:-2]) + detokenizer.update(ids[-2:], finished=True, stop_terminated=True)
    assert text == tokenizer.decode(ids if include_stop_str_in_output else ids[:-1])
    assert text.startswith(" Simple is better") and text.endswith(".") is include_stop_str_in_output
    assert detokenizer.output_text == text


def test_text_held_back_for_stop_strings_is_released_when_the_request_finishes(tokenizer):
    stop = "not in the text"
    output_ids = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    streamed = "".join(detokenizer.update([token_id]) for token_id in output_ids)
    # A stop string could still start in the last len(stop) - 1 characters.
    assert streamed == TEXT[: len(TEXT) - (len(stop) - 1)]
    assert streamed + detokenizer.update([], finished=True) == TEXT
    assert detokenizer.stop_reason is None


def test_each_step_decodes_a_few_ids_not_the_whole_output(tokenizer):
    class RecordingTokenizer:
        def __init__(self):
            self.window_lengths = []

        def decode(self, token_ids, skip_special_tokens):
            self.window_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    output_ids = tokenizer.encode(TEXT * 20)
    recording = RecordingTokenizer()
    text = "".join(stream(IncrementalDetokenizer(recording, tokenizer.encode(PROMPT)), output_ids))
    assert text == TEXT * 20
    assert max(recording.window_lengths) <= 8


@pytest.mark.parametrize("stop", [[""], "stop", [None]])
def test_invalid_stop_strings_are_rejected(tokenizer, stop):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=stop)
