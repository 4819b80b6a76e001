"""Bad sampling values and constraints beyond the grammar library's limits are error rows in
their own words, one line each (issue #50, finding 9): NaN and infinities in any float sampling
field are refused where ``SamplingParams`` is verified (every entry point goes through it); a
regex the library cannot build says so, for every row that asks for it; a 100,000-way choice
compiles; a library panic is one line, without its backtrace."""

from __future__ import annotations

import math

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams, StructuredOutputsParams
from batchgen_data.engine.sampling_params import FLOAT_FIELDS
from batchgen_data.engine.structured.compiler import compile_error
from batchgen_data.errors import ConfigError, one_line
from batchgen_data.operators.rows import StageConfig, prepare_rows

NON_FINITE = [math.nan, math.inf, -math.inf]
REGEX_TOO_LARGE = "RequestError: structured_outputs regex too large to compile: lexer error: too many expressions constructed"


@pytest.fixture(scope="module")
def engine(demo_path):
    with Engine(demo_path, EngineConfig(max_num_seqs=8)) as engine:
        yield engine


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_nan_and_infinities_are_refused_in_every_float_field(field, value):
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value) == f"{field} must be a finite number, got {value}"


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_logit_bias_values_must_be_finite(value):
    with pytest.raises(ConfigError, match=r"^logit_bias\[1\] must be a finite number"):
        SamplingParams(logit_bias={1: value})


def test_a_temperature_float32_cannot_hold_is_refused(engine):
    with pytest.raises(ConfigError, match=r"^temperature must be within \+-3.403e\+38 \(float32's range"):
        SamplingParams(temperature=1e300)
    choices = ["yes", "no"]
    params = SamplingParams(max_tokens=4, temperature=3e38, seed=1, structured_outputs={"choice": choices})
    [out] = engine.generate(["Ready?"], params)  # the largest float32 temperatures sample a choice
    assert out.error is None and out.text in choices


def test_an_infinite_temperature_with_a_constraint_is_a_finite_number_error_not_a_grammar_mismatch(engine):
    """Params hold valid values at every moment (built or set), so no infinite temperature can
    reach the sampler, where it had read as a grammar mismatch; a row's dict gets the error row."""
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    message = "temperature must be a finite number, got inf"
    with pytest.raises(ConfigError, match=message):
        SamplingParams(max_tokens=4, temperature=math.inf, structured_outputs=constraint)
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(ConfigError, match=message):
        params.temperature = math.inf
    [good] = engine.generate(["Ready?"], params)
    assert good.error is None and good.text in ("yes", "no")
    [row] = prepare_rows({"prompt": ["Ready?"], "sampling_params": [
        {"temperature": math.inf, "structured_outputs": {"choice": ["yes", "no"]}}]}, 1, StageConfig())
    assert row.error == f"RowError: invalid sampling_params: {message}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_regex_beyond_the_librarys_limits_fails_every_row_asking_for_it_in_its_own_words(engine, sampled):
    regex = "a{1000000}" if sampled else "b{1000000}"  # each test its own grammar, compiled afresh
    params = SamplingParams(max_tokens=4, temperature=0.8 if sampled else 0.0, seed=1,
                            structured_outputs={"regex": regex})
    first, plain, second = engine.generate(["Hello", "Hello", "Hi"],
                                           [params, SamplingParams(max_tokens=4, temperature=0), params])
    assert first.finish_reason == "error" and first.error == REGEX_TOO_LARGE
    # The library's lexer is shared by the rows of one grammar: the second row's mask already
    # fails (it allowed end-of-sequence alone: the row ended as an empty "stop").
    assert second.finish_reason == "error" and second.error == REGEX_TOO_LARGE
    assert plain.error is None and plain.num_generated_tokens == 4


def test_a_100000_way_choice_compiles_and_gives_one_of_them(engine):
    choices = [f"c{i}" for i in range(100_000)]
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": choices})
    [out] = engine.generate(["Pick one:"], params)
    assert out.error is None and out.finish_reason == "stop" and out.text in set(choices)


def test_a_library_panic_is_one_line_without_its_backtrace():
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
             "   0: <unknown>\n   1: type_call at Objects/typeobject.c:1091:11\n")
    assert compile_error("grammar", panic) == (
        "structured_outputs grammar could not be compiled (the grammar library failed: panic: assertion failed: "
        "grammar.symbols.len() < u16::MAX as usize - 10)")
    assert one_line("thread 'main' panicked at src/lib.rs:1:1:\nboom\nstack backtrace:\n   0: rust_begin_unwind") == \
        "thread 'main' panicked at src/lib.rs:1:1: boom"
    assert one_line("Traceback (most recent call last):\n  File 'x.py', line 1\nValueError: bad\n") == "ValueError: bad"
    assert "RequestError: " + compile_error("regex", "lexer error: too many expressions constructed\n<state>\n"
                                            "Tokens: x\n</state>") == REGEX_TOO_LARGE
