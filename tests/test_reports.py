"""The HTML report and its PNG charts: self-contained, escaped, and showing the database's numbers."""

import re
import shutil
import statistics
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import duckdb
import pytest
from labdb import EVIL, MODEL_A, sweep_db, synthetic_db

from dspark_lab.errors import DsparkError
from dspark_lab.reports import build_report
from dspark_lab.reports.report import CHARTS

ROOT = Path(__file__).resolve().parent.parent
TITLES = ["Speedup vs draft cap", "Decode throughput", "Accept length per round", "Per-position acceptance",
          "Calibration: verify cost by width", "Predicted vs measured round time", "Noise: decode tok/s"]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    # The vega bundle is cached under DSPARK_LAB_CACHE: keep the tests' copy out of ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def evil_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    engine = synthetic_db(root, evil=True)
    html = build_report(engine, root / "report.html", png_dir=root / "png")
    return html.read_text(encoding="utf-8"), root / "png"


class _Rows(HTMLParser):
    """Summary rows of a report: data-arm -> {data-col: cell text}."""

    def __init__(self):
        super().__init__()
        self.rows, self._arm, self._col = {}, None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-arm" in a:
            self._arm = a["data-arm"]
            self.rows[self._arm] = {}
        elif tag == "td" and self._arm is not None:
            self._col = a.get("data-col")
            self.rows[self._arm][self._col] = ""

    def handle_endtag(self, tag):
        if tag == "tr":
            self._arm = None
        elif tag == "td":
            self._col = None

    def handle_data(self, data):
        if self._arm is not None and self._col is not None:
            self.rows[self._arm][self._col] += data


def summary_rows(html: str) -> dict:
    p = _Rows()
    p.feed(html)
    return p.rows


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_report_is_self_contained_with_every_chart(evil_report):
    html, _ = evil_report
    assert len(re.findall(r'"\$schema": ?"https://vega.github.io/schema/vega-lite/v\d', html)) == len(CHARTS)
    for title in TITLES:
        assert title in html, title
    assert "window.vegaEmbed=" in html  # the libraries are inlined ...
    assert not re.search(r"<script[^>]*\bsrc=", html)  # ... and nothing is fetched
    assert "cdn.jsdelivr" not in html and re.search(r'"editor": ?false', html)


def test_model_text_is_escaped(evil_report):
    html, _ = evil_report
    assert EVIL not in html and "<script>alert" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 2  # the model id and the prompt id, as text
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in html  # and inside the chart data


def test_not_lossless_trials_are_flagged_and_kept(evil_report):
    html, _ = evil_report
    assert "2 trial(s) NOT lossless" in html and "2 of 27</span> checked speculative trials" in html
    assert html.count('<tr class="bad"><td><span class="flag">NOT LOSSLESS</span>') == 2
    rows = summary_rows(html)
    lookup = rows[f"Apple M3 Max 64GB (metal)|{MODEL_A}|-|lookup|4|all"]
    assert lookup["lossless"] == "5 / 1 / 0" and lookup["flag"] == "NOT LOSSLESS" and lookup["trials"] == "6"


def test_summary_table_numbers_and_provenance(evil_report):
    rows = summary_rows(evil_report[0])
    r = rows[f"Apple M3 Max 64GB (metal)|{MODEL_A}|heads/qwen3-8b-dspark|dspark|2|all"]
    assert (r["speedup"], r["median_tok_s"], r["baseline_median_tok_s"], r["trials"]) == ("2.000", "200.00", "80.00", "6")
    assert r["device"] == "Apple M3 Max 64GB (metal) (dk-metal)" and r["run_ids"] == "run-metal"
    assert rows[f"Apple M3 Max 64GB (metal)|{MODEL_A}|heads/qwen3-8b-dspark|dspark|2|code"]["speedup"] == "1.750"


def test_png_exports(evil_report):
    _, png_dir = evil_report
    names = sorted(p.stem for p in png_dir.glob("*.png"))
    assert names == sorted(name for name, _, _ in CHARTS)  # calibration and round time included
    for p in png_dir.glob("*.png"):
        w, h = png_size(p)
        assert w > 100 and h > 100 and p.stat().st_size > 1000


def test_pair_filter_and_errors(tmp_path):
    engine = synthetic_db(tmp_path)
    html = build_report(engine, tmp_path / "pair.html", pair="Qwen3-8B-4bit:qwen3-8b-dspark").read_text()
    arms = summary_rows(html)
    assert arms and all(MODEL_A in k for k in arms)
    assert {k.split("|")[3] for k in arms} == {"baseline", "dspark"}  # the pair and its baseline, no lookup
    with pytest.raises(DsparkError, match="no trials of model 'nope'"):
        build_report(engine, tmp_path / "x.html", pair="nope")
    with pytest.raises(DsparkError, match="no trials with drafter 'other'"):
        build_report(engine, tmp_path / "x.html", pair=f"{MODEL_A}:other")
    with pytest.raises(DsparkError, match="no run 'zzz'"):
        build_report(engine, tmp_path / "x.html", run_ids=["zzz"])
    only_cuda = build_report(engine, tmp_path / "cuda.html", run_ids=["run-cuda"]).read_text()
    assert all(k.startswith("NVIDIA H200 (cuda)|") for k in summary_rows(only_cuda))
    assert "No calibration records" in only_cuda  # the metal calibration is not this run's device


def test_empty_database_is_a_clear_error(tmp_path):
    from dspark_lab.db.store import open_db

    with pytest.raises(DsparkError, match="no trials in this database; run `dspark-lab sweep`"):
        build_report(open_db(tmp_path / "empty.duckdb"), tmp_path / "r.html")


def test_real_sweep_report_matches_the_database(tmp_path):
    engine = sweep_db(tmp_path)
    html = build_report(engine, tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    path = engine.url.database
    engine.dispose()  # DuckDB takes one configuration per file per process
    con = duckdb.connect(path, read_only=True)
    trials = con.execute("select drafter_id, mode, cap, domain, prompt_id, decode_tokens_per_sec, mean_accept_len "
                         "from trials").fetchall()
    con.close()
    rows = summary_rows(html)
    assert len(rows) == 3 * 5  # (all, code, chat) x (baseline + lookup 2/4 + dspark 2/4)
    base = {(t[3], t[4]): t[5] for t in trials if t[1] == "baseline"}
    for key, cells in rows.items():
        machine, _model, drafter, mode, cap, domain = key.split("|")
        mine = [t for t in trials if (t[0] or "-", t[1], t[2]) == (drafter, mode, cap) and domain in ("all", t[3])]
        assert cells["trials"] == str(len(mine)), key
        assert cells["median_tok_s"] == f"{statistics.median(t[5] for t in mine):.2f}", key
        assert cells["mean_accept_len"] == f"{statistics.mean(t[6] for t in mine):.3f}", key
        speedup = 1.0 if mode == "baseline" else statistics.median(t[5] / base[(t[3], t[4])] for t in mine)
        assert cells["speedup"] == f"{speedup:.3f}", key
        assert machine in cells["device"] and cells["run_ids"]
        if mode == "dspark":  # the head's weights, named by their digest
            from dspark_lab.engine.loading import weights_digest

            assert cells["drafter"].endswith(f" #{weights_digest(drafter)[:8]}"), cells["drafter"]
    for title in TITLES[:4] + TITLES[-1:]:
        assert title in html
    assert "No calibration records" in html  # this sweep had no cap auto, so nothing was calibrated
    pngs = sorted(p.stem for p in (tmp_path / "png").glob("*.png"))
    assert pngs == ["accept_hist", "noise", "positions", "speedup", "throughput"]


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("google-chrome") is None,
                    reason="no chromium / google-chrome on PATH to render the report (apt-get install chromium)")
def test_report_renders_in_headless_chromium(evil_report, tmp_path):
    html, _ = evil_report
    page = tmp_path / "report.html"
    page.write_text(html, encoding="utf-8")
    shot = tmp_path / "shot.png"
    subprocess.run([str(ROOT / "scripts" / "screenshot_report.sh"), str(page), str(shot), "1000x1200"], check=True,
                   capture_output=True, timeout=120)
    assert png_size(shot) == (1000, 1200)


def test_a_difference_at_a_numerical_tie_is_shown_as_such(tmp_path):
    """A trial whose first difference is a tie stays in the not-lossless list, marked as a tie
    with its logit gap, and its arm's flag says "ties" rather than NOT LOSSLESS."""
    from sqlalchemy import text

    engine = synthetic_db(tmp_path)
    with engine.begin() as conn:
        conn.execute(text("UPDATE trials SET mismatch_gap = 0.125, mismatch_tie = true WHERE lossless = false AND mode = 'lookup' "
                          "AND model_id = :m"), {"m": MODEL_A})
    html = build_report(engine, tmp_path / "r.html").read_text()
    assert "AT A TIE" in html and "0.125 (a tie)" in html and "numerical tie (1 of them" in html
    lookup = summary_rows(html)[f"Apple M3 Max 64GB (metal)|{MODEL_A}|-|lookup|4|all"]
    assert lookup["lossless"] == "5 / 1 (1 at ties) / 0" and lookup["flag"] == "ties"


def test_save_chart_takes_a_chart_or_its_spec(tmp_path):
    """One writer for every chart file: the report passes specs (pinned Vega-Lite), scripts pass charts."""
    import json

    import altair as alt

    from dspark_lab.reports.charts import save_chart

    chart = alt.Chart(alt.Data(values=[{"x": 1, "y": 2}, {"x": 2, "y": 3}])).mark_line().encode(x="x:Q", y="y:Q")
    save_chart(chart.to_dict(), tmp_path / "spec.json")
    assert json.loads((tmp_path / "spec.json").read_text())["mark"]["type"] == "line"
    for source in (chart, chart.to_dict()):
        save_chart(source, tmp_path / "c.png")
        assert png_size(tmp_path / "c.png")[0] > 50


def test_the_calibration_chart_draws_timed_rounds_where_there_are_some():
    """A pipelined calibration's whole rounds (cap c at its verify's width c + 1, plain decoding at
    width 1) are drawn beside verify(w); curves without them draw as before."""
    import json

    import polars as pl

    from dspark_lab.lab.curves import CostCurves, Point
    from dspark_lab.reports.charts import calibration_chart
    from labdb import CURVES

    timed = CostCurves(verify=CURVES.verify, drafter=CURVES.drafter, overhead=CURVES.overhead, depth_slope_ms=0.0,
                       short_ctx=128, long_ctx=1024, rounds={0: Point(9.5, 0.1, 5), 2: Point(10.9, 0.3, 36)})

    def points(curves):
        frame = pl.DataFrame([{"model_id": MODEL_A, "drafter_id": "h", "mode": "dspark-pipe", "machine": "m", "device_key": "d",
                               "options": json.dumps({"max_cap": 4}), "curves": json.dumps(curves.to_dict())}])
        spec = calibration_chart(frame).to_dict()
        values = spec["data"]["values"] if "values" in spec.get("data", {}) else next(iter(spec["datasets"].values()))
        return [(v["width"], v["ms"], v["note"]) for v in values if v["kind"] == "round"]

    assert points(timed) == [(1, 9.5, "plain decoding, timed as it runs"), (3, 10.9, "a whole round at cap 2, timed as it runs")]
    assert points(CURVES) == []


def test_two_versions_of_a_head_in_one_arm_are_flagged(tmp_path):
    """A head continued and stored again at its path, measured before and after, pools two heads
    in one row: the report says so instead of showing one digest."""
    from labdb import HEAD_A, METAL, PROMPTS, trial
    from sqlmodel import Session

    from dspark_lab.db.store import open_db
    from dspark_lab.schemas.records import Run

    engine = open_db(tmp_path / "two.duckdb")
    with Session(engine) as s:
        s.add(Run(id="r", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=METAL, device_stamp="{}", config="{}"))
        for n, p in enumerate(PROMPTS):
            s.add(trial("r", MODEL_A, "baseline", "0", p, 0, 100.0))
            t = trial("r", MODEL_A, "dspark", "2", p, 0, 150.0, drafter=HEAD_A)
            t.drafter_digest = "aaaaaaaaaaaaaaaa" if n % 2 else "bbbbbbbbbbbbbbbb"
            s.add(t)
        s.commit()
    html = build_report(engine, tmp_path / "r.html").read_text()
    assert "2 versions of the drafter pooled" in html and "#aaaaaaaa" not in html


def test_a_database_with_precisions_shows_them_trial_by_trial(tmp_path):
    """A sweep at two precisions: the report has a section pairing each trial at 8 bits with the
    same prompt and repeat as loaded, its numbers db.queries.paired_precisions'; a database of one
    precision has no such section."""
    from dspark_lab.db import open_db
    from dspark_lab.db.queries import paired_precisions
    from dspark_lab.lab.sweep import SweepConfig, run_sweep
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    cfg = SweepConfig(models=[str(model)], modes=["baseline", "lookup"], caps=["2"], prompt_sets=["code"], prompt_limit=2,
                      trials=1, max_new_tokens=6, precisions=["as-loaded", "8"])
    db = tmp_path / "p.duckdb"
    run_sweep(cfg, db, progress=False)
    engine = open_db(db)
    try:
        html = build_report(engine, tmp_path / "p.html").read_text()
        pairs = paired_precisions(engine)
    finally:
        engine.dispose()
    assert 'id="precisions"' in html and 'href="#precisions"' in html
    section = html[html.index('id="precisions"'):html.index('id="lossless"')]
    for r in pairs.iter_rows(named=True):
        assert f'<td data-col="ratio">{r["ratio"]:.3f}</td>' in section
    assert section.count('<td data-col="precision">q8</td>') == pairs.height == 2  # baseline and lookup at 8 bits
    one = tmp_path / "one.duckdb"
    run_sweep(SweepConfig(models=[str(model)], modes=["baseline"], prompt_sets=["code"], prompt_limit=1, trials=1,
                          max_new_tokens=4), one, progress=False)
    engine = open_db(one)
    try:
        assert 'id="precisions"' not in build_report(engine, tmp_path / "one.html").read_text()
    finally:
        engine.dispose()
