"""The pages' words for recorded values: wire formats as phrases, seconds with units, no program reprs; and the
scanner the page tests use finds what it should."""

from __future__ import annotations

from dutycycle.trainer.app.demo_report import readable, wire_formats

from ..support.pages import raw_values


def test_wire_formats_read_as_phrases():
    assert wire_formats({"grads_bits": 8, "weights_bits": 32, "block": 256, "error_feedback": False}) == \
        "int8 gradients in blocks of 256, no error feedback"
    assert wire_formats({"grads_bits": 4, "weights_bits": 8, "block": 64, "error_feedback": True,
                         "two_hop": True}) == \
        "int4 gradients in blocks of 64, int8 weight gathers, error feedback, two hops (inside the node, then across)"
    assert wire_formats({"grads_bits": 32, "weights_bits": 32, "grads_all_to_all": True}) == \
        "fp32 gradients, exchanged by all-to-all"
    # unquantized, an fp64 run sends float64 (qcollectives keeps the input's dtype), a bf16 run reduces in fp32
    assert wire_formats({"grads_bits": 32, "weights_bits": 32, "grads_all_to_all": True}, "fp64") == \
        "fp64 gradients, exchanged by all-to-all"
    assert wire_formats({"grads_bits": 32, "weights_bits": 32}, "bf16") == "fp32 gradients"


def test_recorded_values_read_with_units():
    assert readable("recovery_s", 15.163434147000771) == "15.2 s"
    assert readable("error", None) == "-" and readable("resumed", True) == "yes"
    assert readable("ratio", 0.123456) == "0.123" and readable("steps_lost", 20) == "20"
    assert readable("stall", {"mean_s": 0.0081, "saves": 3}) == "mean 0.0081 s, saves 3"


def test_the_scanner_finds_program_values_and_skips_images():
    assert raw_values("<td>None</td>") and raw_values("<td>{'a': 1}</td>") and raw_values("<td>15.163434147</td>")
    assert not raw_values("<td>15.2 s</td><img src='data:image/png;base64,Tm9uZQNone0.1234567'>")


def test_a_panel_with_nothing_measured_says_why_instead_of_empty_axes():
    import matplotlib.pyplot as plt
    from dutycycle.trainer.diagnose.report import figure

    fig = figure({"compute": {"samples_per_s": 900.0, "samples_per_s_per_worker": 450.0, "workers": 2,
                              "device": "cpu"},
                  "memory": {"skipped": "the budget was spent (3 s left of 60 s)"}})
    rates, waits, memory = ([t.get_text() for t in ax.texts] for ax in fig.axes)
    plt.close(fig)
    assert not rates  # the compute ceiling was measured: drawn, not explained
    assert "end to end" in " ".join(waits).lower() and "not run" in " ".join(waits)
    assert "skipped: the budget was spent (3 s left of 60 s)" in " ".join(memory).replace("\n", " ")


def test_the_link_checker_finds_what_a_browser_could_not_open(tmp_path):
    from ..support.pages import unresolved

    (tmp_path / "here.html").write_text("x")
    png = "data:image/png;base64,iVBORw0KGgo="  # the PNG signature
    page = f"<a href='here.html'>a</a><img src='{png}'><a href='gone.html'>b</a><img src='data:image/png;base64,AAAA'>"
    assert unresolved(page, tmp_path) == ["gone.html", "data:image/png;base64,AAAA"]


def test_verified_remedies_are_drawn_against_their_predictions():
    import matplotlib.pyplot as plt
    from dutycycle.trainer.diagnose.report import figure

    checked = [{"for": "checkpoint", "set": ["checkpoint.async_save=true"], "predicted_samples_per_s": 100.0,
                "measured_samples_per_s": 93.0, "measured_over_predicted": 0.93},
               {"for": "data", "set": ["data.source=cache"], "predicted_samples_per_s": 50.0}]  # not verified
    fig = figure({}, checked)
    try:
        assert len(fig.axes) == 4
        labels = [t.get_text() for t in fig.axes[3].texts]
        assert labels == ["0.93x"] and "measured / predicted" in fig.axes[3].get_title()
    finally:
        plt.close(fig)
    fig = figure({}, checked[1:])  # nothing verified: no fourth panel
    assert len(fig.axes) == 3
    plt.close(fig)
