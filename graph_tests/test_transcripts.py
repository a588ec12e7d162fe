"""The rule test_readme.py compares console transcripts by (graph_tests/transcripts.py): every
word and number exact, a measured error within an order of magnitude."""

import doctest
import re

import pytest

from . import transcripts
from .transcripts import errors_agree, tokens, transcript_differences

#: a transcript as docs/pipeline.md shows it (run on the CPU the page was written on)
PAGE = """\
engine sim, 4 ranks: 2 pipeline stages on pp, 1f1b over 4 micro-batches
  output loss: max abs err 0, max rel err 0
  grad x: max abs err 0, max rel err 0
  grad l0_w: max abs err 1.43e-06, max rel err 2.14e-07
  collective all-reduce on dp for grad/cos: 2048 bytes/rank
memory per rank 10,723,424 bytes on stage 0
matches one device
"""


def test_the_same_output_agrees():
    assert transcript_differences(PAGE, PAGE) == []
    assert transcript_differences(PAGE, "\n" + PAGE + "\n\n") == []  # blank space around the whole output


def test_measured_errors_of_another_cpu_agree():
    # what OPENBLAS_CORETYPE=Prescott printed for docs/pipeline.md: a 0 became a few ulps, the others moved
    other = PAGE.replace("grad x: max abs err 0, max rel err 0", "grad x: max abs err 1.43e-06, max rel err 3.68e-07")
    other = other.replace("1.43e-06, max rel err 2.14e-07", "1.67e-06, max rel err 2.5e-07")
    assert other != PAGE and transcript_differences(PAGE, other) == []


@pytest.mark.parametrize("far", ["2.5e-05", "1.5e-05", "inf", "nan", "0.000143"])
def test_a_measured_error_far_off_fails(far):
    other = PAGE.replace("max abs err 1.43e-06", f"max abs err {far}")
    (difference,) = transcript_differences(PAGE, other)
    assert difference.startswith("line 4:") and "1.43e-06" in difference


def test_a_zero_error_that_grows_past_the_floor_fails():
    other = PAGE.replace("grad x: max abs err 0", "grad x: max abs err 1.2e-05")
    assert len(transcript_differences(PAGE, other)) == 1


@pytest.mark.parametrize("old, new", [
    ("2048 bytes", "2049 bytes"),          # an integer
    ("10,723,424", "10,723,425"),          # a grouped integer
    ("4 ranks", "8 ranks"),
    ("stage 0\n", "stage 1\n"),
    ("1f1b", "gpipe"),                     # a word
    ("matches one device", "differs from one device"),
    ("all-reduce", "all-gather"),
    ("grad l0_w", "grad l1_w"),            # a digit inside a name
    ("dp for", "dp  for"),                 # blank space inside a line
    ("engine sim", "engine mindspore"),
])
def test_a_changed_word_or_integer_fails(old, new):
    other = PAGE.replace(old, new, 1)
    assert other != PAGE
    assert len(transcript_differences(PAGE, other)) == 1


def test_a_decimal_that_is_not_a_measured_error_is_exact():
    page = "step time 120.0 us; the busiest stage idles 0.641 of its busy time\n"
    assert transcript_differences(page, page.replace("0.641", "0.642")) != []
    assert transcript_differences(page, page.replace("120.0", "120")) != []
    # "err" elsewhere is no label: a number after it is exact
    assert transcript_differences("stderr 1.5e-06\n", "stderr 1.6e-06\n") != []


def test_a_missing_or_extra_line_fails():
    assert transcript_differences(PAGE, PAGE.replace("matches one device\n", "")) != []
    assert transcript_differences(PAGE, PAGE + "note: one more\n") != []


def test_a_measured_error_where_the_page_has_words_fails():
    page = "  output y: max abs err 0, max rel err 0\n"
    assert transcript_differences(page, "  output y: max abs error 0, max rel err 0\n") != []
    assert transcript_differences(page, "  output y: max abs err 0 , max rel err 0\n") != []


def test_the_tolerance_is_an_order_of_magnitude_with_a_floor():
    assert errors_agree("1e-06", "9.9e-06") and not errors_agree("1e-06", "1.01e-05")
    assert errors_agree("0", "1e-06") and errors_agree("0", "9.9e-06") and not errors_agree("0", "1.01e-05")
    assert errors_agree("1.9e-05", "2e-06") and not errors_agree("2.1e-05", "2e-06")  # smaller counts too
    assert errors_agree("3e-16", "0")  # float64 rounding: both under the floor
    assert errors_agree("inf", "inf") and not errors_agree("inf", "nan")


def test_tokens_join_back_into_the_line():
    line = "  grad l0_w: max abs err 1.43e-06, max rel err 2.14e-07 on a100-80g [2, 4] 10,723,424"
    parts = tokens(line)
    assert "".join(text for _, text in parts) == line
    assert [text for kind, text in parts if kind == "measured"] == ["1.43e-06", "2.14e-07"]


def test_the_module_examples_run():
    result = doctest.testmod(transcripts, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 5


def test_every_tiny_number_in_the_pages_transcripts_is_a_measured_error():
    """A number in e-notation in a transcript is, in this tool's output, a measured error: one that is not
    after a label of MEASURED would be compared digit for digit and pass only on the CPU it was recorded on
    (add its label to transcripts.MEASURED, or print it at a precision that holds on every CPU)."""
    from .test_readme import EXAMPLE_PAGES, _transcript_commands

    measured, unlabelled = 0, []
    for page in EXAMPLE_PAGES:
        for command, expected in _transcript_commands(page):
            if command.startswith("cat > "):
                continue  # a heredoc: a file the page writes (a spec's eps: 1e-6), not output
            for line in expected.splitlines():
                for kind, text in tokens(line):
                    measured += kind == "measured"
                    if kind == "exact" and re.fullmatch(r"[-+]?\d+(\.\d+)?[eE][-+]?\d+", text):
                        unlabelled.append(f"{page.name}: {command}: {line}")
    assert unlabelled == [] and measured >= 10
