"""labkit.predict: what a learner types is read as they meant it, and the reveal says how far off it was."""

import pytest

from labkit.predict import Reveal, parse_number, predict


@pytest.mark.parametrize(
    ("text", "unit", "value"),
    [
        ("1536", "B", 1536.0),
        ("1,536", "B", 1536.0),
        ("1.5e6", "B", 1.5e6),
        ("1.5 MB", "B", 1.5e6),
        ("180 GB", "B", 180e9),
        ("250 ms", "s", 0.25),
        ("3.6", "s", 3.6),
        ("2 GiB", "B", 2 * 2**30),
        ("512 KiB", "B", 512 * 1024),
        ("3x", "x", 3.0),
        ("34 rows", "rows", 34.0),
        ("1 row", "rows", 1.0),
        ("16k tokens", "tokens", 16e3),
        ("  ", "B", None),
    ],
)
def test_parse_number_reads_units_and_prefixes(text, unit, value):
    assert parse_number(text, unit) == value


@pytest.mark.parametrize("text", ["lots", "2 GB per s s", "1.2.3", "3 ms", "1e", "2 Gb"])
def test_parse_number_refuses_with_a_sentence(text):
    with pytest.raises(ValueError, match="type e.g."):
        parse_number(text, "B")


def test_a_decimal_comma_is_refused_not_read_as_thousands():
    with pytest.raises(ValueError, match="type decimals with a point: 1.5"):
        parse_number("1,5", "s")


def test_no_prediction_reveals_the_measurement_and_formula_and_no_mistake(capsys):
    # "Run All" with the box empty: nobody made the usual mistake, so the reveal does not name it.
    shown = predict("Bytes one rank sends", "B").reveal(
        1536, formula=1536, formula_text="(n-1)/n x 2,048 B", mistake="each rank already holds 1/n"
    )
    assert shown.predicted is None and not shown.right and shown.ratio is None
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "Bytes one rank sends: measured 1,536 B.",
        "No prediction entered (type one in the box above, then run this cell again).",
        "Formula (n-1)/n x 2,048 B = 1,536 B: equal to the byte.",
    ]
    assert "computed / formula = 2" in str(Reveal("t", "s", 2.0, None, formula=1.0, source="computed"))
    # seconds summed in another order are equal up to rounding (0.1 + 0.2 is 0.30000000000000004)
    assert "Formula: 300 ms: equal." in str(Reveal("t", "s", 0.1 + 0.2, None, formula=0.3))


def test_a_miss_names_the_factor_and_the_usual_mistake(capsys):
    shown = predict("Bytes one rank sends", "B", value=2048).reveal(
        1536, mistake="each rank already holds 1/n"
    )
    assert shown.ratio == pytest.approx(4 / 3) and not shown.right
    out = capsys.readouterr().out
    assert (
        "1.33x the measurement (too high)" in out and "The usual mistake: each rank already holds 1/n" in out
    )


def test_a_close_prediction_is_right_and_hides_the_mistake():
    shown = Reveal("Step time", "s", measured=0.120, predicted=0.118, mistake="never shown")
    assert shown.right
    assert "right (within 5%)" in str(shown) and "never shown" not in str(shown)
    assert "1/1.2 of the measurement (too low)" in str(Reveal("t", "s", 0.12, 0.1))


def test_the_widget_box_is_what_the_prediction_reads():
    guess = predict("Bytes one rank sends", "B")
    guess.widget()
    guess._box.value = "1.5 kB"
    assert guess.value == 1500.0
    guess._box.value = "not a number"
    assert guess.reveal(1500).predicted is None  # reported in a sentence, not raised
