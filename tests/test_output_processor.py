"""Output processing without a model: incremental detokenization (characters split across tokens), stop strings
and stop_regex held back while ambiguous, trimmed or kept, and what the core is told to stop."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tritonllm.interface.parameters import SamplingParams
from tritonllm.model_files import prepare_default_model
from tritonllm.engine.processing.detokenizer import IncrementalDetokenizer
from tritonllm.engine.processing.output_processor import OutputProcessor, held_back_length
from tritonllm.engine.processing.outputs import ChoiceDelta
from core_fakes import PieceTokenizer, core_output

class Choice:
    """One choice streamed through an OutputProcessor token by token, recording every delta."""

    def __init__(self, params: SamplingParams, tokenizer: PieceTokenizer | None = None):
        self.tokenizer = tokenizer or PieceTokenizer()
        self.processor = OutputProcessor(self.tokenizer)
        self.processor.add_request("r", self.tokenizer.ids("Say", ":"), params)
        self.deltas: list[ChoiceDelta] = []
        self.stopped: list[int] = []  # sequences the processor told the core to stop

    def feed(self, *pieces: str | bytes, finish_reason: str | None = None, stop_token_id: int | None = None) -> str:
        """One core output per piece (the last one carrying finish_reason); returns the text they released."""
        released = ""
        for i, token_id in enumerate(self.tokenizer.ids(*pieces)):
            last = i == len(pieces) - 1
            output, stopped = self.processor.process(core_output(
                "r", [token_id], finish_reason if last else None, stop_token_id if last else None))
            self.stopped += stopped
            if output is not None:
                self.deltas += output.choices
                released += "".join(delta.text for delta in output.choices)
        return released

    @property
    def text(self) -> str:
        return "".join(delta.text for delta in self.deltas)

    @property
    def finish(self) -> tuple[str | None, str | int | None]:
        ends = [(delta.finish_reason, delta.matched_stop) for delta in self.deltas if delta.finish_reason]
        assert len(ends) <= 1, ends
        return ends[0] if ends else (None, None)


def test_a_stop_string_spanning_tokens_is_held_back_then_trimmed():
    choice = Choice(SamplingParams(stop=["STOP"]))
    assert choice.feed("Hel") == "Hel"
    assert choice.feed("lo ST") == "lo "  # "ST" may begin "STOP"
    assert choice.feed("O") == ""
    assert choice.feed("P and more") == ""
    assert choice.text == "Hello " and choice.finish == ("stop", "STOP")
    assert choice.stopped == [0]  # still running in the core, which must abort it
    assert choice.deltas[-1].token_ids == choice.tokenizer.ids("O", "P and more")  # held tokens go with the end
    assert choice.feed(" late") == "" and choice.processor.requests == {}  # what the core made after it is dropped


def test_no_stop_trim_keeps_the_stop_string():
    choice = Choice(SamplingParams(stop=["STOP"], no_stop_trim=True))
    choice.feed("Hello ST", "OP and more")
    assert choice.text == "Hello STOP" and choice.finish == ("stop", "STOP")


def test_held_back_text_that_does_not_become_a_stop_is_released():
    choice = Choice(SamplingParams(stop=["STOP"]))
    assert choice.feed("Hello ST") == "Hello "
    assert choice.feed("ART") == "START"
    assert choice.feed("S") == ""
    assert choice.feed("T", finish_reason="length") == "ST"  # the end releases what was held
    assert choice.text == "Hello STARTST" and choice.finish == ("length", None) and choice.stopped == []


def test_the_earliest_of_overlapping_stops_wins():
    choice = Choice(SamplingParams(stop=["cd", "bcde"]))
    choice.feed("ab", "cdef")
    assert choice.text == "a" and choice.finish == ("stop", "bcde")


def test_stop_regex_is_held_back_while_it_may_match_and_trimmed():
    pattern = r"\d+\."
    choice = Choice(SamplingParams(stop_regex=[pattern]))
    assert choice.feed("Total: 4") == "Total: "
    assert choice.feed("2") == ""
    assert choice.feed(" apples") == "42 apples"  # "42 " can no longer match
    assert choice.feed(" or 1") == " or "
    assert choice.feed(". Done") == ""
    assert choice.text == "Total: 42 apples or " and choice.finish == ("stop", pattern)
    assert choice.stopped == [0]


def test_stop_regex_no_stop_trim_keeps_the_match():
    choice = Choice(SamplingParams(stop_regex=[r"\d+\."], no_stop_trim=True))
    choice.feed("Total: 4", "2", ". Done")
    assert choice.text == "Total: 42."


@pytest.mark.parametrize("stop", [{"stop": ["2"]}, {"stop_regex": [r"\d"]}], ids=["stop", "stop_regex"])
def test_stops_made_before_min_tokens_do_not_count(stop):
    choice = Choice(SamplingParams(min_tokens=3, **stop))
    choice.feed("2 apples", " and")
    assert choice.finish == (None, None)
    choice.feed(" 2 pears")  # the third token: from here on a stop ends the choice
    assert choice.text == "2 apples and " and choice.finish[0] == "stop"


def test_a_stop_token_is_trimmed_unless_no_stop_trim():
    trimmed = Choice(SamplingParams())
    end = trimmed.tokenizer.id(" END")
    trimmed.feed("Done", " END", finish_reason="stop", stop_token_id=end)
    assert trimmed.text == "Done" and trimmed.finish == ("stop", end)
    assert trimmed.deltas[-1].token_ids == [end]  # the token itself is still reported

    kept = Choice(SamplingParams(no_stop_trim=True))
    end = kept.tokenizer.id(" END")
    kept.feed("Done", " END", finish_reason="stop", stop_token_id=end)
    assert kept.text == "Done END"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_left_out_with_skip_special_tokens(skip):
    choice = Choice(SamplingParams(skip_special_tokens=skip))
    choice.feed("a", "<|eos|>", "b", finish_reason="length")
    assert choice.text == ("ab" if skip else "a<|eos|>b")


def test_characters_split_across_tokens_are_emitted_whole():
    choice = Choice(SamplingParams())
    party = "🎉".encode()  # four bytes, one token each
    assert choice.feed("caf", b"\xc3") == "caf"
    assert choice.feed(b"\xa9") == "é"
    released = [choice.feed(piece) for piece in (b" " + party[:1], party[1:2], party[2:3], party[3:])]
    assert released == ["", "", "", " 🎉"]
    assert choice.text == "café 🎉" and all("\ufffd" not in delta.text for delta in choice.deltas)


def test_word_boundary_spaces_survive_a_decoder_that_drops_the_leading_space():
    choice = Choice(SamplingParams(), PieceTokenizer(strips_leading_space=True))
    assert [choice.feed(piece) for piece in (" Hello", " world", ",", " again")] == [" Hello", " world", ",", " again"]


def test_a_stop_string_after_a_split_character_is_found():
    choice = Choice(SamplingParams(stop=["é!"]))
    choice.feed("caf", b"\xc3", b"\xa9", "! more")
    assert choice.text == "caf" and choice.finish == ("stop", "é!")


def test_choices_of_one_request_stop_independently():
    tokenizer = PieceTokenizer()
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", tokenizer.ids("Say", ":"), SamplingParams(n=2, stop=["!"]))
    [hi, ho] = tokenizer.ids("hi!", "ho")
    output, stopped = processor.process(core_output("r", [hi], index=0))
    assert stopped == [0] and not output.finished and output.choices[0].text == "hi"
    output, stopped = processor.process(core_output("r", [ho], index=1, finish_reason="length"))
    assert stopped == [] and output.finished and output.choices[0].text == "ho"
    assert processor.requests == {}


@pytest.mark.parametrize("text, stops, patterns, held", [
    ("Hello ST", ["STOP"], [], 2),
    ("Hello STOP", ["STOP"], [], 0),  # a whole stop is found, not held
    ("Hello S", ["STOP", "SO"], [], 1),
    ("abab", ["abac"], [], 2),  # the longest suffix that begins a stop
    ("x = 12", [], [r"\d+;"], 2),
    ("x = 12", [], [r"\d+$"], 0),  # already a full match: nothing partial
    ("plain", ["STOP"], [r"\d+;"], 0),
])
def test_held_back_length(text, stops, patterns, held):
    compiled = SamplingParams(stop_regex=patterns).stop_patterns
    assert held_back_length(text, stops, compiled, 0) == held


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """The default model's byte-level BPE tokenizer (its tokenizer.json alone: no model, no transformers)."""
    return Tokenizer.from_file(str(prepare_default_model() / "tokenizer.json"))


@pytest.mark.parametrize("text", ["café 🎉 and 中文：你好，world", " leading space,  double  spaces\nnew line 👋",
                                  "emoji only 🎉🎉👍🏽"])
def test_incremental_detokenization_equals_decoding_everything(bpe_tokenizer, text):
    prompt = bpe_tokenizer.encode("Say:").ids
    detokenizer = IncrementalDetokenizer(prompt, skip_special_tokens=True)
    ids = bpe_tokenizer.encode(text).ids
    pieces = [detokenizer.add(bpe_tokenizer, token_id) for token_id in ids]
    assert "".join(pieces) == bpe_tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # the text did split characters across tokens
