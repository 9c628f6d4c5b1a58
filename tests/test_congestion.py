"""The congestion study (notebook 08): its variants, its knee rule on tables made by hand, its bad input, and one
small run through the simulator on Dask's threads."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvlab.studies import congestion as study


def test_variants_parse_and_bad_ones_are_named():
    assert study.parse_variant("layerwise+fp8") == ("layerwise", True, False)
    assert study.parse_variant("deadline+admission+fp8") == ("deadline", True, True)
    with pytest.raises(ValueError, match="'layerwise\\+zip' is not a send variant"):
        study.parse_variant("layerwise+zip")
    with pytest.raises(ValueError, match="variants = 'bulk,bulk'"):
        study.check({"variants": "bulk,bulk"})


@pytest.mark.parametrize("field, value, says", [
    ("loads", "0.5,0.2", "increasing offered loads"),
    ("loads", "0.5,1.0", "between 0 and 1"),
    ("links", "100Q", "links: '100Q'"),
    ("size", "huge", "size = 'huge' is not valid; valid: auto, full, small"),
    ("oversubscription", 0.5, "oversubscription = 0.5: must be ≥ 1"),
    ("model", "llama-9", "model: "),
])
def test_bad_input_is_refused_in_one_line(field, value, says):
    with pytest.raises(ValueError, match=None) as err:
        study.check({field: value})
    assert says in str(err.value) and "\n" not in str(err.value)


def _table(p99s, loads=(0.2, 0.5, 0.8), prefill_ms=50.0):
    return pd.DataFrame({"link": "400G", "variant": "layerwise", "load": list(loads),
                         "transfer_exposed_p99_ms": list(p99s), "prefill_ms": prefill_ms})


def test_the_knee_is_the_first_load_past_a_tenth_of_prefill():
    k = study.knees(_table([1.0, 4.9, 5.1])).iloc[0]  # threshold 5 ms: 0.8 is the first over it
    assert k.threshold_ms == pytest.approx(5.0) and k.knee_load == 0.8 and k.below == 0.5 and not k.beyond
    k = study.knees(_table([1.0, 2.0, 5.0])).iloc[0]  # 5.0 is not past 5.0
    assert k.beyond and math.isnan(k.knee_load) and k.below == 0.8
    k = study.knees(_table([6.0, 7.0, 9.0])).iloc[0]  # past it already at the lowest load
    assert k.knee_load == 0.2 and math.isnan(k.below)
    assert "already at the lowest load" in study._knee_words(k)


def test_a_small_run_simulates_every_point_and_finds_what_the_calculator_says_alone(tmp_path):
    cfg = study.check({"size": "small", "links": "400G", "variants": "bulk,layerwise", "loads": "0.1,0.5"})
    assert len(cfg.points()) == 4
    flows = study.single_flow(cfg)
    from kvlab.fabric.sweep import run_points

    rows = run_points(cfg.points(), processes=False, n_workers=1, progress=False)
    a = study.analyse({"resolved": cfg.resolved()}, {"points": rows, "single_flow": flows})
    t = a.tables["congestion"]
    assert len(t) == 4 and set(a.tables["knees"]["variant"]) == {"bulk", "layerwise"}
    # bulk's whole transfer is exposed: at a light load the simulated median cannot be less than the calculator's
    # single flow (the same bytes on the same NIC rate, nothing faster to share with)
    bulk = t[(t["variant"] == "bulk") & (t["load"] == 0.1)].iloc[0]
    assert bulk.transfer_exposed_p50_ms >= 0.95 * bulk.calc_exposed_ms
    assert set(study.figures(a)) == set(study.FIGURES)
