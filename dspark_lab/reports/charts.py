"""The report's charts, one function each, from the frames in dspark_lab.db.queries.

Each returns an altair chart, or None when the database holds nothing it could show (the
report then says so instead of drawing an empty frame). Data goes in as inline values with
explicit field types, so the specs do not depend on altair's dataframe conversion, and every
string (model names, prompt ids) reaches vega as data, which it draws as text, never as HTML.
"""

from __future__ import annotations

import json

import altair as alt
import polars as pl

from ..db.queries import cap_order
from ..lab.controller import DEFAULT_ACCEPTANCE, static_cap
from ..lab.curves import CostCurves
from ..lab.sweep import NON_DRAFTING_MODES
from ..engine.names import short_name

WIDTH, HEIGHT = 240, 170  # one facet panel
RED = "#c0392b"  # reserved for "not lossless", so no mode may be drawn in red


MODE_COLORS = {"baseline": "#4c78a8", "lookup": "#54a24b", "dspark": "#f58518", "dspark-pipe": "#9d755d", "dspark-tree": "#e45756", "dspark-tree-pipe": "#ff9da6", "dflash": "#b279a2", "draft": "#72b7b2", "draft-pipe": "#ff9da6", "mlx-lm": "#bab0ac", "compiled-step": "#79706e", "plain-step": "#d6a5c9"}


def _mode_color(df: pl.DataFrame) -> alt.Color:
    """One fixed color per mode (the same in every chart), listing only the modes present."""
    present = [m for m in MODE_COLORS if m in set(df["mode"].to_list())]
    others = sorted(set(df["mode"].to_list()) - set(MODE_COLORS))
    return alt.Color("mode:N", title="mode", scale=alt.Scale(
        domain=present + others, range=[MODE_COLORS[m] for m in present] + ["#9d755d"] * len(others)))


_EXTRA = ["#72b7b2", "#eeca3b", "#ff9da6", "#9d755d", "#bab0ac", "#8c6d31", "#393b79", "#637939"]  # no red


def _series_color(df: pl.DataFrame) -> alt.Color:
    """Lines named by mode keep the mode's color; mode:drafter lines get their own."""
    series = sorted(set(df["series"].to_list()))
    extra = iter(_EXTRA * (1 + len(series) // len(_EXTRA)))
    return alt.Color("series:N", title="mode", scale=alt.Scale(
        domain=series, range=[MODE_COLORS.get(x) or next(extra) for x in series]))


def _row() -> alt.Row:
    """Facet rows by panel, labelled above each row (vertical side labels of long model names overlap)."""
    return alt.Row("panel:N", title=None, header=alt.Header(labelAngle=0, labelOrient="top", labelAnchor="start",
                                                           labelFontWeight="bold", labelFontSize=12, labelLimit=900))


def _data(df: pl.DataFrame) -> alt.Data:
    return alt.Data(values=df.to_dicts())


def label_arms(df: pl.DataFrame) -> pl.DataFrame:
    """Add display labels: `model`, `drafter` (short names), `series` (mode and drafter, the line
    a cap sweep draws), `arm` (series and cap) and `panel` (model on machine, one facet row)."""
    model = pl.col("model_id").map_elements(short_name, return_dtype=pl.String)
    drafter = pl.col("drafter_id").map_elements(short_name, return_dtype=pl.String)
    df = df.with_columns(model=model, drafter=pl.when(pl.col("drafter_id").is_null()).then(pl.lit("-")).otherwise(drafter))
    # Name the drafter only where a model was measured with several for one mode; otherwise the
    # mode says it all (the tables name every drafter).
    several = pl.col("drafter_id").n_unique().over("machine", "model_id", "mode") > 1
    series = pl.when(several).then(pl.format("{}:{}", pl.col("mode"), pl.col("drafter"))).otherwise(pl.col("mode"))
    df = df.with_columns(series=series)
    arm = (pl.when(pl.col("mode").is_in(NON_DRAFTING_MODES)).then(pl.col("mode"))  # no cap: they do not draft
           .otherwise(pl.format("{} cap {}", pl.col("series"), pl.col("cap"))))
    return df.with_columns(arm=arm, panel=pl.format("{} on {}", pl.col("model"), pl.col("machine").fill_null("?")))


def _arm_sort(df: pl.DataFrame) -> list[str]:
    """Arms in reading order: baseline, then each series by cap."""
    rows = df.select("arm", "mode", "series", "cap").unique().to_dicts()
    rows.sort(key=lambda r: (r["mode"] != "baseline", r["series"], cap_order(r["cap"])))
    return list(dict.fromkeys(r["arm"] for r in rows))


def _caps(df: pl.DataFrame) -> list[str]:
    return sorted(set(df["cap"].to_list()), key=cap_order)


def speedup_chart(summary: pl.DataFrame) -> alt.FacetChart | None:
    """Speedup over the baseline against the cap, one panel per domain, CI as error bars."""
    df = label_arms(summary).filter((pl.col("mode") != "baseline") & pl.col("speedup").is_not_null())
    if df.is_empty():
        return None
    df = df.with_columns(run_ids=pl.col("run_ids").list.join(", "), device_keys=pl.col("device_keys").list.join(", "))
    x = alt.X("cap:O", title="draft cap", sort=_caps(df), axis=alt.Axis(labelAngle=0))
    color = _series_color(df)
    tooltip = ["arm:N", "domain:N", alt.Tooltip("speedup:Q", format=".3f"), alt.Tooltip("ci_lo:Q", format=".3f"),
               alt.Tooltip("ci_hi:Q", format=".3f"), "trials:Q", "prompts:Q", "machine:N", "device_keys:N", "run_ids:N"]
    base = alt.Chart().encode(x=x, color=color)
    layers = alt.layer(
        alt.Chart().mark_rule(strokeDash=[4, 3], color="#777").encode(y=alt.datum(1.0)),
        base.mark_errorbar(ticks=True).encode(y=alt.Y("ci_lo:Q", title="speedup (x baseline)", scale=alt.Scale(zero=False)),
                                              y2="ci_hi:Q"),
        base.mark_line(point=True).encode(y="speedup:Q", tooltip=tooltip),
        # A red ring marks an arm with a trial that did not reproduce the baseline: kept, never hidden.
        # Solid: a real divergence; dashed: every difference was a numerical tie (see lossless.py).
        alt.Chart().mark_point(size=260, strokeWidth=2.5, color=RED, filled=False).encode(
            x=x, y="speedup:Q", tooltip=["arm:N", "not_lossless_trials:Q", "tie_trials:Q", "trials:Q"]).transform_filter(
            alt.datum.not_lossless_trials - alt.datum.tie_trials > 0),
        alt.Chart().mark_point(size=260, strokeWidth=2, strokeDash=[3, 2], color=RED, filled=False).encode(
            x=x, y="speedup:Q", tooltip=["arm:N", "not_lossless_trials:Q", "tie_trials:Q", "trials:Q"]).transform_filter(
            (alt.datum.tie_trials > 0) & (alt.datum.not_lossless_trials - alt.datum.tie_trials <= 0)),
        data=_data(df),
    ).properties(width=WIDTH, height=HEIGHT)
    return layers.facet(column=alt.Column("domain:N", title="domain"), row=_row()).properties(
        title="Speedup vs draft cap (median over prompts, 95% bootstrap CI)")


def throughput_chart(summary: pl.DataFrame) -> alt.FacetChart | None:
    """Median decode tok/s of every arm beside its baseline, per domain."""
    df = label_arms(summary)
    if df.is_empty():
        return None
    # Outline width: 3 for a real divergence, 1 when every difference was a numerical tie.
    real = pl.col("not_lossless_trials") - pl.col("tie_trials")
    df = df.with_columns(run_ids=pl.col("run_ids").list.join(", "),
                         ring=pl.when(real > 0).then(3).when(pl.col("tie_trials") > 0).then(1).otherwise(0))
    chart = alt.Chart(_data(df)).mark_bar().encode(
        x=alt.X("arm:N", title=None, sort=_arm_sort(df), axis=alt.Axis(labelAngle=-40, labelLimit=160)),
        y=alt.Y("median_tok_s:Q", title="median decode tok/s"),
        color=_mode_color(df),
        stroke=alt.condition(alt.datum.not_lossless_trials > 0, alt.value(RED), alt.value(None)),
        strokeWidth=alt.StrokeWidth("ring:Q", scale=None, legend=None),
        tooltip=["arm:N", "domain:N", alt.Tooltip("median_tok_s:Q", format=".1f"),
                 alt.Tooltip("baseline_median_tok_s:Q", format=".1f"), "trials:Q", "not_lossless_trials:Q", "tie_trials:Q",
                 "machine:N", "run_ids:N"],
    ).properties(width=WIDTH, height=HEIGHT)
    return chart.facet(column=alt.Column("domain:N", title="domain"), row=_row()).resolve_scale(x="independent", y="independent").properties(
        title="Decode throughput: baseline vs speculative (median tok/s; red outline: not lossless, thin: only at ties)")


def accept_hist_chart(trials: pl.DataFrame) -> alt.FacetChart | None:
    """Distribution of tokens committed per round (accept length, bonus token included) per arm."""
    df = trials.filter(~pl.col("mode").is_in(NON_DRAFTING_MODES))  # the modes that draft
    if df.is_empty():
        return None
    df = (label_arms(df).select("panel", "arm", "mode", "series", "cap", "accept_lengths").explode("accept_lengths")
          .drop_nulls("accept_lengths").rename({"accept_lengths": "accept_len"}))
    if df.is_empty():
        return None
    counts = df.group_by("panel", "arm", "mode", "series", "cap", "accept_len").agg(rounds=pl.len())
    counts = counts.with_columns(share=pl.col("rounds") / pl.col("rounds").sum().over("panel", "arm"),
                                 label=pl.format("{} | {}", pl.col("arm"), pl.col("panel")))
    order = sorted(counts.select("panel", "arm", "label", "mode", "series", "cap").unique().to_dicts(),
                   key=lambda r: (r["panel"], r["mode"], r["series"], cap_order(r["cap"])))
    chart = alt.Chart(_data(counts)).mark_bar().encode(
        x=alt.X("accept_len:O", title="tokens committed per round", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("share:Q", title="share of rounds", axis=alt.Axis(format="%")),
        color=_mode_color(counts),
        tooltip=["panel:N", "arm:N", "accept_len:O", "rounds:Q", alt.Tooltip("share:Q", format=".1%")],
    ).properties(width=180, height=120)
    facet = alt.Facet("label:N", title=None, sort=[r["label"] for r in order], header=alt.Header(labelLimit=260))
    return chart.facet(facet=facet, columns=4).properties(
        title="Accept length per round (all prompts, all trials)")


def position_chart(summary_all: pl.DataFrame) -> alt.FacetChart | None:
    """Conditional acceptance at each draft position d0..dk per arm (pooled over domains)."""
    df = label_arms(summary_all).filter(~pl.col("mode").is_in(NON_DRAFTING_MODES))
    rows = []
    for r in df.iter_rows(named=True):
        for i, p in enumerate(r["per_position_acceptance"] or []):
            rows.append({"panel": r["panel"], "arm": r["arm"], "position": f"d{i}", "i": i, "acceptance": p,
                         "trials": r["trials"]})
    if not rows:
        return None
    pos = pl.DataFrame(rows)
    chart = alt.Chart(_data(pos)).mark_line(point=True).encode(
        x=alt.X("position:O", title="draft position", sort=alt.EncodingSortField("i"), axis=alt.Axis(labelAngle=0)),
        y=alt.Y("acceptance:Q", title="acceptance", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("arm:N", title="arm", sort=_arm_sort(label_arms(df))),
        tooltip=["arm:N", "position:O", alt.Tooltip("acceptance:Q", format=".3f"), "trials:Q"],
    ).properties(width=2 * WIDTH, height=HEIGHT)
    return chart.facet(row=_row()).properties(title="Per-position acceptance (d0..dk)")


def _parse_curves(text: str) -> CostCurves | None:
    try:
        curves = CostCurves.from_dict(json.loads(text))
        return curves if curves.verify else None
    except Exception:  # noqa: BLE001 - a damaged record is skipped, like calibrate.load_stored does
        return None


def calibration_label(row: dict) -> str:
    drafter = f":{short_name(row['drafter_id'])}" if row.get("drafter_id") else ""
    return f"{short_name(row['model_id'])} {row['mode']}{drafter} on {row['machine']} ({row['device_key']})"


def max_cap_of(row: dict, curves: CostCurves) -> int:
    """The largest cap the calibration measured for (its options say; else its widths do)."""
    try:
        return int(json.loads(row.get("options") or "{}")["max_cap"])
    except (KeyError, TypeError, ValueError):
        return max(max(curves.drafter, default=0), max(curves.verify) - 1, 1)


def calibration_chart(calibration: pl.DataFrame) -> alt.FacetChart | None:
    """verify(w) as measured (median, spread), the fitted knee model, the whole rounds where the
    calibration timed them (mode dspark-pipe: a round at cap c at its verify's width c + 1, plain
    decoding at width 1), and the width the static cap implies at the mode's default acceptance,
    one panel per calibration record. Where rounds were timed they, not verify(w) plus the draft,
    are what the controller weighs: the gap between a round and its verify is the draft and the
    loop's own work less what the pipelining overlaps."""
    rows = []
    for r in calibration.iter_rows(named=True):
        curves = _parse_curves(r["curves"])
        if curves is None:
            continue
        label = calibration_label(r)
        cap = static_cap(curves, DEFAULT_ACCEPTANCE.get(r["mode"], 0.7), max_cap_of(r, curves))
        for w, p in sorted(curves.verify.items()):
            rows.append({"panel": label, "kind": "measured", "width": w, "ms": p.median_ms,
                         "lo": p.median_ms - p.spread_ms / 2, "hi": p.median_ms + p.spread_ms / 2, "samples": p.samples})
        for w in range(1, max(curves.verify) + 1):
            rows.append({"panel": label, "kind": "fit", "width": w, "ms": curves.fit(w)})
        for c, p in sorted(curves.rounds.items()):
            rows.append({"panel": label, "kind": "round", "width": c + 1, "ms": p.median_ms, "samples": p.samples,
                         "note": "plain decoding, timed as it runs" if c == 0 else f"a whole round at cap {c}, timed as it runs"})
        rows.append({"panel": label, "kind": "static cap", "width": cap + 1, "ms": curves.verify_ms(cap + 1),
                     "note": f"static cap {cap} (verify width {cap + 1})" if cap else "static cap 0: plain decoding wins",
                     "knee": curves.fit.knee})
    if not rows:
        return None
    data = _data(pl.DataFrame(rows, infer_schema_length=None))
    x = alt.X("width:Q", title="verify width (tokens per target forward)", axis=alt.Axis(tickMinStep=1, format="d"))
    ms = "ms per forward (diamonds: per round)"
    layers = alt.layer(
        alt.Chart().mark_line(color="#555").encode(x=x, y=alt.Y("ms:Q", title=ms)).transform_filter(
            alt.datum.kind == "fit"),
        alt.Chart().mark_errorbar().encode(x=x, y=alt.Y("lo:Q", title=ms), y2="hi:Q").transform_filter(alt.datum.kind == "measured"),
        alt.Chart().mark_point(filled=True, size=40).encode(
            x=x, y=alt.Y("ms:Q", title=ms), tooltip=["width:Q", alt.Tooltip("ms:Q", format=".3f"), "samples:Q"]).transform_filter(
            alt.datum.kind == "measured"),
        alt.Chart().mark_point(shape="diamond", size=60, color=MODE_COLORS["dspark-pipe"], filled=True).encode(
            x=x, y=alt.Y("ms:Q", title=ms), tooltip=["note:N", alt.Tooltip("ms:Q", format=".3f"), "samples:Q"]).transform_filter(
            alt.datum.kind == "round"),
        alt.Chart().mark_rule(color=RED, strokeDash=[4, 3]).encode(x=x, tooltip=["note:N", "knee:Q"]).transform_filter(
            alt.datum.kind == "static cap"),
        alt.Chart().mark_text(color=RED, align="left", dx=4, dy=-6).encode(x=x, y="ms:Q", text="note:N").transform_filter(
            alt.datum.kind == "static cap"),
        data=data,
    ).properties(width=2 * WIDTH, height=HEIGHT)
    return layers.facet(facet=alt.Facet("panel:N", title=None), columns=2).resolve_scale(x="independent").properties(
        title="Calibration: verify cost by width (points), knee fit (line), whole rounds where timed (diamonds, at their "
              "verify's width), and the static cap at the default acceptance")


def predicted_round_ms(curves: CostCurves, trial: dict) -> float | None:
    """Mean round time the curves predict for this trial's rounds, each at the width it really
    drafted and at its real context depth (baseline rounds: one plain forward)."""
    accepts, drafts = trial["accept_lengths"] or [], trial["draft_lengths"] or []
    if not accepts:
        return None
    depth, total = trial["prompt_tokens"], 0.0
    for a, d in zip(accepts, drafts):
        if trial["mode"] == "baseline":
            total += curves.plain_ms(depth)
        elif d <= 0:  # a lookup round with no match: one plain forward plus the loop's overhead
            total += curves.plain_ms(depth) + max(0.0, curves.overhead.median_ms)
        else:
            total += curves.round_ms(d, depth)
        depth += a
    return total / len(accepts)


def round_time_frame(trials: pl.DataFrame, calibration: pl.DataFrame) -> pl.DataFrame:
    """Predicted vs measured mean round time for every trial whose pair has stored curves on the
    same device (same device_key). Measured = decode seconds / rounds."""
    curves_for: dict[tuple, CostCurves] = {}
    for r in calibration.sort("created_at").iter_rows(named=True):  # newest record wins
        curves = _parse_curves(r["curves"])
        if curves is not None:
            curves_for[(r["device_key"], r["model_id"], r["mode"], r["drafter_id"])] = curves
            curves_for.setdefault((r["device_key"], r["model_id"], "baseline", None), curves)
    if not curves_for or trials.is_empty():
        return pl.DataFrame()
    rows = []
    for t in label_arms(trials).iter_rows(named=True):
        curves = curves_for.get((t["device_key"], t["model_id"], t["mode"], t["drafter_id"]))
        if curves is None or not t["num_rounds"] or not t["decode_seconds"]:
            continue
        predicted = predicted_round_ms(curves, t)
        if predicted is None:
            continue
        rows.append({"panel": t["panel"], "arm": t["arm"], "mode": t["mode"], "prompt_id": t["prompt_id"],
                     "run_id": t["run_id"], "predicted_ms": predicted,
                     "measured_ms": t["decode_seconds"] * 1000.0 / t["num_rounds"]})
    return pl.DataFrame(rows)


def round_time_chart(trials: pl.DataFrame, calibration: pl.DataFrame) -> alt.FacetChart | None:
    df = round_time_frame(trials, calibration)
    if df.is_empty():
        return None
    hi = float(max(df["predicted_ms"].max(), df["measured_ms"].max())) * 1.05
    diagonal = _data(pl.DataFrame({"predicted_ms": [0.0, hi], "measured_ms": [0.0, hi]}))
    points = alt.Chart(_data(df)).mark_point(filled=True, opacity=0.7).encode(
        x=alt.X("predicted_ms:Q", title="predicted ms per round (cost curves)", scale=alt.Scale(domain=[0, hi])),
        y=alt.Y("measured_ms:Q", title="measured ms per round", scale=alt.Scale(domain=[0, hi])),
        color=alt.Color("arm:N", title="arm"), shape=alt.Shape("mode:N", title="mode"),
        tooltip=["panel:N", "arm:N", "prompt_id:N", "run_id:N", alt.Tooltip("predicted_ms:Q", format=".3f"),
                 alt.Tooltip("measured_ms:Q", format=".3f")],
    )
    line = alt.Chart(diagonal).mark_line(color="#999", strokeDash=[4, 3]).encode(x="predicted_ms:Q", y="measured_ms:Q")
    return alt.layer(line, points).properties(width=2 * WIDTH, height=2 * HEIGHT,
                                              title="Predicted vs measured round time (dashed: equal)")


def lossless_status(df: pl.DataFrame) -> pl.Expr:
    return (pl.when(pl.col("mode") == "baseline").then(pl.lit("baseline"))
            .when((pl.col("lossless") == False) & (pl.col("mismatch_tie") == True)).then(pl.lit("differs at a tie"))  # noqa: E712
            .when(pl.col("lossless") == False).then(pl.lit("NOT lossless"))  # noqa: E712
            .when(pl.col("lossless") == True).then(pl.lit("lossless"))  # noqa: E712
            .otherwise(pl.lit("unchecked")))


def noise_chart(trials: pl.DataFrame) -> alt.FacetChart | None:
    """Every trial's decode tok/s per arm: how much one arm varies between trials and prompts."""
    if trials.is_empty():
        return None
    df = label_arms(trials).with_columns(status=lossless_status(trials))
    df = df.select("panel", "arm", "mode", "series", "cap", "domain", "prompt_id", "trial_index", "run_id", "status",
                   pl.col("decode_tokens_per_sec").alias("tok_s"))
    statuses = ["baseline", "lossless", "unchecked", "differs at a tie", "NOT lossless"]
    y = alt.Y("arm:N", title=None, sort=_arm_sort(df))
    box = alt.Chart().mark_boxplot(extent="min-max", opacity=0.35, color="#888").encode(x=alt.X("tok_s:Q", title="decode tok/s"), y=y)
    pts = alt.Chart().mark_point(filled=True, size=45).encode(
        x="tok_s:Q", y=y, shape=alt.Shape("domain:N", title="domain"),
        color=alt.Color("status:N", title="lossless check",
                        scale=alt.Scale(domain=statuses, range=["#4c78a8", "#54a24b", "#bab0ac", "#f1a7a0", RED])),
        tooltip=["arm:N", "domain:N", "prompt_id:N", "trial_index:Q", "run_id:N", "status:N", alt.Tooltip("tok_s:Q", format=".1f")],
    )
    layers = alt.layer(box, pts, data=_data(df)).properties(width=2 * WIDTH + 120)
    # Each model on each machine gets its own axes: its arms, and its own tok/s range.
    return layers.facet(row=_row()).resolve_scale(x="independent", y="independent").properties(
        title="Noise: decode tok/s of every trial per arm (box: min-max and quartiles)")


def save_chart(chart: alt.TopLevelMixin | dict, out, *, vl_version: str | None = None) -> None:
    """A chart (or its Vega-Lite spec) to a file by its suffix: .png rendered offline (vl-convert;
    every chart's data is inline, so no URL may be fetched; `vl_version` pins the spec's
    Vega-Lite version), anything else as altair saves it (.html, .json spec)."""
    from pathlib import Path

    out = Path(out)
    if out.suffix == ".png":
        import vl_convert as vlc

        spec = chart if isinstance(chart, dict) else chart.to_dict()
        pin = {"vl_version": vl_version} if vl_version else {}
        out.write_bytes(vlc.vegalite_to_png(spec, scale=1.0, allowed_base_urls=[], **pin))
    else:
        if isinstance(chart, dict):
            chart = alt.Chart.from_dict(chart)
        chart.save(str(out))
