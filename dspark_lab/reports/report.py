"""One self-contained HTML report of a results database, optionally with every chart as a PNG.

The page works offline: the vega / vega-lite / vega-embed JavaScript comes from the
vl-convert-python wheel and is inlined once; each chart is a vega-lite spec embedded as JSON.
Everything from the database (model, drafter and prompt names, run ids) is escaped: tables with
html.escape, specs by escaping `<`, `>` and `&` inside the JSON so no string can close the
script element; vega itself draws strings as text.

Trials flagged not lossless are counted, listed and drawn in red, never dropped.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from pathlib import Path

import altair as alt
import polars as pl
from sqlalchemy import Engine

from ..db.queries import calibration_frame, paired_precisions, runs_frame, summary, trials_frame
from ..errors import DsparkError
from . import charts
from ..engine.names import matches, short_name
from .vega_js import javascript_bundle

# (id, title, chart builder name, caption): the order charts appear in.
CHARTS = (
    ("speedup", "Speedup vs cap",
     "Median over prompts of (arm tok/s / baseline tok/s on the same prompt in the same run), with a 95% bootstrap interval over "
     "prompts. The dashed line is the baseline (1.0); a red ring marks an arm with a trial that was not lossless."),
    ("throughput", "Throughput",
     "Median decode tokens per second of each arm and of the plain-decoding baseline."),
    ("accept_hist", "Accept lengths",
     "Tokens committed per verify round (accepted drafts plus the model's own token)."),
    ("positions", "Per-position acceptance",
     "Share of rounds that accepted draft position i, among those that drafted that deep and accepted every "
     "earlier position."),
    ("calibration", "Calibration cost curves",
     "Measured target-forward cost by width (median, spread as bars), the knee fit, and the width of the cap "
     "static_cap picks at the mode's default acceptance."),
    ("round_time", "Predicted vs measured round time",
     "Each trial's mean round time against what the stored cost curves of the same pair on the same device "
     "predict for the widths it drafted."),
    ("noise", "Noise",
     "Every trial's decode tok/s: the spread between repeats and prompts of one arm."),
)


def _vl_version() -> str | None:
    """The vega-lite version altair writes, in vl-convert's spelling, if vl-convert has it."""
    import vl_convert as vlc

    want = ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])
    return want if want in vlc.get_vegalite_versions() else None


def _script_json(obj) -> str:
    """JSON safe inside a <script> element: no string in it can end the element or open a comment."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def parse_pair(pair: str | tuple[str, str | None] | None) -> tuple[str, str | None] | None:
    """`MODEL[:DRAFTER]` (or a (model, drafter) tuple) -> (model, drafter or None)."""
    if pair is None or isinstance(pair, tuple):
        return pair
    model, _, drafter = str(pair).partition(":")
    if not model:
        raise DsparkError(f"--pair {pair!r} names no model; write MODEL or MODEL:DRAFTER.")
    return model, drafter or None


def _filter_pair(trials: pl.DataFrame, pair: tuple[str, str | None]) -> pl.DataFrame:
    model, drafter = pair
    keep_model = pl.Series([matches(m, model) for m in trials["model_id"].to_list()], dtype=pl.Boolean)
    out = trials.filter(keep_model)
    if out.is_empty():
        have = ", ".join(sorted({short_name(m) for m in trials["model_id"].to_list()})) or "none"
        raise DsparkError(f"--pair: no trials of model {model!r} (models here: {have}).")
    if drafter is not None:
        # A named pair keeps its own arms and the baseline they are measured against.
        keep = pl.Series([mode == "baseline" or matches(d, drafter)
                          for mode, d in zip(out["mode"].to_list(), out["drafter_id"].to_list())], dtype=pl.Boolean)
        if not any(d is not None and matches(d, drafter) for d in out["drafter_id"].to_list()):
            have = ", ".join(sorted({short_name(d) for d in out["drafter_id"].to_list() if d})) or "none"
            raise DsparkError(f"--pair: model {model!r} has no trials with drafter {drafter!r} (drafters here: {have}).")
        out = out.filter(keep)
    return out


def _relevant_calibration(calibration: pl.DataFrame, trials: pl.DataFrame, filtered: bool) -> pl.DataFrame:
    """All calibrations for a whole-database report; those of the shown models and devices when
    the report is narrowed to some runs or one pair."""
    if not filtered or calibration.is_empty():
        return calibration
    keys, models = set(trials["device_key"].to_list()), set(trials["model_id"].to_list())
    return calibration.filter(pl.col("device_key").is_in(list(keys)) & pl.col("model_id").is_in(list(models)))


# --- tables ------------------------------------------------------------------------------------


def _stamp(run: dict) -> dict:
    try:
        return json.loads(run.get("device_stamp") or "{}")
    except json.JSONDecodeError:
        return {}


def _runs_table(runs: pl.DataFrame, trials: pl.DataFrame) -> str:
    counts = dict(trials.group_by("run_id").agg(pl.len()).iter_rows())
    head = ("run id", "status", "source", "started", "finished", "machine", "device key", "dspark-lab", "mlx", "mlx-lm",
            "git commit", "trials")
    rows = []
    for r in runs.sort("started_at").iter_rows(named=True):
        s = _stamp(r)
        commit = (s.get("git_commit") or "")[:10] + (" (dirty)" if s.get("git_dirty") else "")
        cells = (r["id"], r["status"], r["source"], (r["started_at"] or "")[:19], (r["finished_at"] or "")[:19], r["machine"],
                 r["device_key"], r["dspark_lab_version"], s.get("mlx_version"), s.get("mlx_lm_version"), commit or "-",
                 counts.get(r["id"], 0))
        rows.append("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    return _table("runs", head, rows)


def _table(cls: str, head, rows: list[str]) -> str:
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


SUMMARY_HEAD = ("domain", "mode", "drafter", "cap", "median tok/s", "baseline tok/s", "share of limit", "speedup", "95% CI", "mean accept",
                "acceptance d0..dk", "trials", "prompts", "lossless / NOT / unchecked", "flag", "device", "run ids")


def _summary_rows(df: pl.DataFrame) -> list[str]:
    rows = []
    for r in df.iter_rows(named=True):
        ties = r["tie_trials"]
        bad = r["not_lossless_trials"] - ties > 0  # a difference that is not a numerical tie
        flag = ('<span class="flag">NOT LOSSLESS</span>' if bad else
                '<span class="flag">ties</span>' if ties else "")
        ci = "-" if r["ci_lo"] is None else f"[{r['ci_lo']:.3f}, {r['ci_hi']:.3f}]"
        profile = " ".join(f"{p:.2f}" for p in r["per_position_acceptance"] or []) or "-"
        device = f"{r['machine']} ({', '.join(r['device_keys'])})"
        # Which weights of the drafter ran (its digest), so two versions of a head kept at one
        # path (a fixture continued each session) are told apart; more than one is flagged.
        digests = r.get("drafter_digests") or []
        drafter = short_name(r["drafter_id"]) + (f" #{digests[0][:8]}" if len(digests) == 1 else "")
        if len(digests) > 1:
            flag += f'<span class="flag">{len(digests)} versions of the drafter pooled</span>'
        cells = [
            ("domain", r["domain"]), ("mode", r["mode"]), ("drafter", drafter), ("cap", r["cap"]),
            ("median_tok_s", _fmt(r["median_tok_s"], ".2f")), ("baseline_median_tok_s", _fmt(r["baseline_median_tok_s"], ".2f")),
            ("limit_share", _fmt(r["limit_share"], ".1%")),
            ("speedup", _fmt(r["speedup"])), ("ci", ci), ("mean_accept_len", _fmt(r["mean_accept_len"])),
            ("per_position_acceptance", profile), ("trials", r["trials"]), ("prompts", r["prompts"]),
            # The baseline is the reference the others are checked against: nothing to count.
            ("lossless", "-" if r["mode"] == "baseline" else
             f"{r['lossless_trials']} / {r['not_lossless_trials']}"
             + (f" ({ties} at ties)" if ties else "") + f" / {r['unchecked_trials']}"),
        ]
        tds = "".join(f'<td data-col="{c}">{_esc(v)}</td>' for c, v in cells)
        tds += f'<td data-col="flag">{flag}</td><td data-col="device">{_esc(device)}</td>'
        tds += f'<td data-col="run_ids">{_esc(", ".join(r["run_ids"]))}</td>'
        arm = "|".join(str(r[k]) if r[k] is not None else "-" for k in ("machine", "model_id", "drafter_id", "mode", "cap", "domain"))
        cls = "arm bad" if bad else "arm"
        rows.append(f'<tr class="{cls}" data-arm="{_esc(arm)}">{tds}</tr>')
    return rows


def _summary_section(df: pl.DataFrame) -> str:
    """A table per (machine, model), its rows in summary order (baseline first in each domain)."""
    out = []
    for (machine, model), g in df.group_by("machine", "model_id", maintain_order=True):
        keys = sorted({k for ks in g["device_keys"].to_list() for k in ks})
        out.append(f'<h3>{_esc(short_name(model))} <span class="dim">on {_esc(machine)} '
                   f'(device key {_esc(", ".join(keys))}; model id {_esc(model)})</span></h3>')
        out.append(_table("summary", SUMMARY_HEAD, _summary_rows(g)))
    return "\n".join(out)


PRECISIONS_HEAD = ("model", "precision", "mode", "drafter", "cap", "domain", "pairs", "tok/s over as loaded", "95% CI", "device")


def _precisions_section(pairs: pl.DataFrame) -> str:
    """Each labelled precision's decode speed over the model as loaded, trial by trial
    (db.queries.paired_precisions): which copy is faster, where each summary row's speedup is over
    its own precision's plain decoding."""
    rows = []
    for r in pairs.iter_rows(named=True):
        cells = [("model", short_name(r["model"])), ("precision", r["precision"]), ("mode", r["mode"]),
                 ("drafter", short_name(r["drafter_id"])), ("cap", r["cap"]), ("domain", r["domain"]), ("pairs", r["pairs"]),
                 ("ratio", _fmt(r["ratio"])), ("ci", f"[{r['ci_lo']:.3f}, {r['ci_hi']:.3f}]"), ("device", r["machine"])]
        rows.append("<tr>" + "".join(f'<td data-col="{c}">{_esc(v)}</td>' for c, v in cells) + "</tr>")
    return ('<p class="meta">The same prompt and repeat at both precisions (a sweep runs them a moment apart); over 1: '
            "faster than the model as loaded. Each row's median is over its pairs, the interval a bootstrap over them.</p>"
            + _table("precisions", PRECISIONS_HEAD, rows))


def _lossless_section(trials: pl.DataFrame) -> str:
    spec = trials.filter(pl.col("mode") != "baseline")
    bad = spec.filter(pl.col("lossless") == False)  # noqa: E712
    unchecked = spec.filter(pl.col("lossless").is_null()).height
    checked = spec.height - unchecked
    if bad.is_empty():
        text = f'<p class="ok">All {checked} checked speculative trials match the baseline token for token.'
        return text + (f" {unchecked} had no baseline to compare with." if unchecked else "") + "</p>"
    head = ("flag", "run id", "model", "drafter", "mode", "cap", "prompt set", "prompt id", "trial", "first mismatch at token",
            "logit gap there", "machine")
    rows = []
    for r in bad.sort("run_id", "model_id", "mode", "cap", "prompt_id").iter_rows(named=True):
        tie = r["mismatch_tie"] is True
        gap = "-" if r["mismatch_gap"] is None else f"{r['mismatch_gap']:.4g}" + (" (a tie)" if tie else "")
        cells = (r["run_id"], r["model_id"], r["drafter_id"] or "-", r["mode"], r["cap"], r["prompt_set"], r["prompt_id"],
                 r["trial_index"], r["mismatch_index"], gap, r["machine"])
        flag = "AT A TIE" if tie else "NOT LOSSLESS"
        rows.append(f'<tr class="bad"><td><span class="flag">{flag}</span></td>'
                    + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    ties = int((bad["mismatch_tie"] == True).sum())  # noqa: E712
    text = (f'<p class="bad-count"><span class="flag">{bad.height} of {checked}</span> checked speculative trials did '
            "NOT reproduce the baseline's tokens. They are kept in every number and chart above; a lossless engine "
            "must never produce one, so treat it as a bug"
            + (f", except where the first difference is a numerical tie ({ties} of them: the two competing logits "
               "within one rounding step of their dtype plus how far forwards of other widths move their gap, so GPU kernels "
               "of different widths may order them either way)"
               if ties else "") + ".</p>")
    return text + _table("not-lossless", head, rows)


# --- the page ----------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 24px 32px; color: #222; }
h1 { margin-bottom: 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { margin: 20px 0 6px; font-size: 16px; } .dim { color: #777; font-weight: normal; font-size: 13px; }
.meta { color: #555; font-size: 13px; } nav a { margin-right: 12px; font-size: 13px; }
table { border-collapse: collapse; font-size: 12px; margin: 6px 0 12px; }
th, td { border: 1px solid #ddd; padding: 3px 5px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td { white-space: nowrap; }
td[data-col="run_ids"], td[data-col="device"] { color: #555; min-width: 110px; max-width: 240px; white-space: normal; }
td[data-col="device"] { min-width: 190px; } td[data-col="per_position_acceptance"] { white-space: normal; min-width: 90px; }
tr.bad td { background: #fdecea; } .flag { color: #fff; background: #c0392b; padding: 1px 5px; border-radius: 3px; font-weight: bold; }
.ok { color: #1e7e34; } .bad-count { font-weight: bold; } figure { margin: 12px 0 28px; }
figcaption { color: #555; font-size: 13px; max-width: 900px; margin-top: 4px; } .missing { color: #888; font-style: italic; }
"""


def _render_charts(frames: dict) -> dict[str, alt.TopLevelMixin | None]:
    s, s_all, t, cal = frames["summary"], frames["summary_all"], frames["trials"], frames["calibration"]
    return {
        "speedup": charts.speedup_chart(s),
        "throughput": charts.throughput_chart(s),
        "accept_hist": charts.accept_hist_chart(t),
        "positions": charts.position_chart(s_all),
        "calibration": charts.calibration_chart(cal),
        "round_time": charts.round_time_chart(t, cal),
        "noise": charts.noise_chart(t),
    }


def _missing_reason(name: str) -> str:
    return {
        "calibration": "No calibration records for these models and devices (`dspark-lab calibrate`, or a sweep with cap auto, stores them).",
        "round_time": "No trial has stored cost curves of the same pair on the same device to predict from.",
    }.get(name, "Nothing to show for the selected trials.")


def build_report(engine: Engine, out_html: Path, run_ids: list[str] | None = None,
                 pair: str | tuple[str, str | None] | None = None, png_dir: Path | None = None,
                 *, n_boot: int = 1000, seed: int = 0) -> Path:
    """Write the report for `run_ids` (all runs when None), narrowed to one `pair`
    ("MODEL[:DRAFTER]") if given, to `out_html`; with `png_dir`, also each chart as
    <png_dir>/<chart id>.png (ids in CHARTS; a chart with nothing to show has no file, as it has
    no figure in the page). Returns the HTML path. Raises DsparkError when nothing matches."""
    out_html = Path(out_html)
    pair = parse_pair(pair)
    trials = trials_frame(engine, run_ids)
    if pair is not None and not trials.is_empty():
        trials = _filter_pair(trials, pair)
    if trials.is_empty():
        where = f"runs {', '.join(run_ids)}" if run_ids else "this database"
        raise DsparkError(f"no trials in {where}; run `dspark-lab sweep` into it first (or check --db / --run).")
    shown_runs = sorted(set(trials["run_id"].to_list()))
    frames = {
        "trials": trials,
        "summary": summary(engine, n_boot=n_boot, seed=seed, trials=trials),
        "summary_all": summary(engine, n_boot=n_boot, seed=seed, by_domain=False, trials=trials),
        "calibration": _relevant_calibration(calibration_frame(engine), trials, run_ids is not None or pair is not None),
        "precisions": paired_precisions(engine, n_boot=n_boot, seed=seed, trials=trials),
    }
    runs = runs_frame(engine, shown_runs)
    rendered = _render_charts(frames)
    vl_version = _vl_version()

    specs, figures = {}, []
    for name, title, caption in CHARTS:
        chart = rendered[name]
        figures.append(f'<h2 id="{name}">{_esc(title)}</h2>')
        if chart is None:
            figures.append(f'<p class="missing">{_esc(_missing_reason(name))}</p>')
            continue
        specs[name] = chart.to_dict()
        figures.append(f'<figure><div id="chart-{name}"></div><figcaption>{_esc(caption)}</figcaption></figure>')

    if png_dir is not None:
        png_dir = Path(png_dir)
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, spec in specs.items():
            charts.save_chart(spec, png_dir / f"{name}.png", vl_version=vl_version)

    n_bad = trials.filter((pl.col("mode") != "baseline") & (pl.col("lossless") == False)).height  # noqa: E712
    title = "dspark-lab report" + (f": {short_name(pair[0])}" + (f" + {short_name(pair[1])}" if pair[1] else "") if pair else "")
    machines = sorted({m for m in trials["machine"].to_list() if m})
    meta = (f"{trials.height} trials in {len(shown_runs)} run(s) on {', '.join(machines) or 'unknown machine'}; "
            f"generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} from {engine.url.database}. "
            "Speedups compare each arm with the same model's plain decoding on the same prompts, same device.")
    bad_note = (f' <span class="flag">{n_bad} trial(s) NOT lossless</span> (see <a href="#lossless">Lossless check</a>)'
                if n_bad else "")
    precisions = "" if frames["precisions"].is_empty() else (
        '<h2 id="precisions">Precisions, trial by trial</h2>\n' + _precisions_section(frames["precisions"]))
    links = [("summary", "Summary"), *([("precisions", "Precisions")] if precisions else []), ("lossless", "Lossless check"),
             *[(n, t) for n, t, _ in CHARTS],
             ("domains", "Per-domain detail"), ("runs", "Runs")]
    nav = " ".join(f'<a href="#{n}">{_esc(t)}</a>' for n, t in links)
    embed_opts = {"renderer": "svg", "actions": {"export": True, "source": False, "compiled": False, "editor": False}}
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{_esc(title)}</title>
<style>{_CSS}</style>
<script type="text/javascript">
{javascript_bundle(vl_version)}
</script>
</head>
<body>
<h1>{_esc(title)}</h1>
<p class="meta">{_esc(meta)}{bad_note}</p>
<nav>{nav}</nav>
<h2 id="summary">Summary per pair</h2>
<p class="meta">All domains pooled. Every number sits beside the device (machine and device key) it was measured on,
its trial count and its run ids; per-domain rows are in <a href="#domains">Per-domain detail</a>.</p>
{_summary_section(frames["summary_all"])}
{precisions}
<h2 id="lossless">Lossless check</h2>
{_lossless_section(trials)}
{"".join(figures)}
<h2 id="domains">Per-domain detail</h2>
{_summary_section(frames["summary"])}
<h2 id="runs">Runs</h2>
{_runs_table(runs, trials)}
<script type="text/javascript">
const specs = {_script_json(specs)};
const opts = {_script_json(embed_opts)};
for (const [name, spec] of Object.entries(specs)) {{
  const el = document.getElementById("chart-" + name);
  vegaEmbed(el, spec, opts).catch((err) => {{ el.textContent = "chart failed to render: " + err; }});
}}
</script>
</body>
</html>
"""
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(page, encoding="utf-8")
    return out_html
