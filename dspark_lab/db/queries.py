"""Summary queries over a results database, in one place: the trials as a polars frame, and
one summary row per arm (speedup over the same model's baseline on the same prompts, with a
bootstrap CI over prompts). Reports and the registry both read through here, so a number means
the same thing wherever it is shown.

Rows are read through SQLAlchemy (no pyarrow needed) into frames with an explicit schema, so an
empty database or an all-null column still has the right types.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from datetime import datetime

import numpy as np
import polars as pl
from sqlalchemy import Engine, select

from ..engine.names import plain_decoding_model
from ..errors import DsparkError
from ..schemas.records import CalibrationRecord, Run, Trial

# JSON text columns of `trials` parsed into lists (the rest, e.g. output_ids, stay text: only
# a mismatch hunt needs them).
_LIST_COLUMNS = {
    "accept_lengths": pl.List(pl.Int64),
    "draft_lengths": pl.List(pl.Int64),
    "per_position_acceptance": pl.List(pl.Float64),
    "caps_chosen": pl.List(pl.Int64),
}
# Run columns carried onto every trial: where (and by what) each number was measured.
_RUN_COLUMNS = ("machine", "device_key", "dspark_lab_version")

# A trial's prompt identity for pairing an arm with its baseline: the same prompt text (set, id
# and prompt_key: _with_prompt_key), the same length budget and temperature, on the same device.
# The id comes before the key so the bootstrap sees a set's prompts in id order, as it did when
# the key was the set version, one for the whole set.
PROMPT_KEY = ["device_key", "prompt_set", "prompt_id", "prompt_key", "max_new_tokens", "temperature"]
# What fixes a prompt's text where its digest is unknown: a set version hashes every prompt of the
# set as run, so one (set, version, id) is one text.
_PROMPT_IN_SET = ["prompt_set", "prompt_set_version", "prompt_id"]
ARM_KEY = ["machine", "model_id", "drafter_id", "mode", "cap", "domain"]


def _polars_type(column) -> pl.DataType:
    try:
        py = column.type.python_type
    except NotImplementedError:
        py = str
    if py is bool:
        return pl.Boolean
    if py is int:
        return pl.Int64
    if py is float:
        return pl.Float64
    return pl.String  # strings, and datetimes as ISO text (DuckDB hands some back tz-aware, some naive)


def _frame(engine: Engine, table, where=None, columns: Iterable[str] | None = None) -> pl.DataFrame:
    cols = [c for c in table.columns if columns is None or c.name in columns]
    schema = {c.name: _polars_type(c) for c in cols}
    query = select(*cols)
    if where is not None:
        query = query.where(where)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    rows = [tuple(v.isoformat() if isinstance(v, datetime) else v for v in row) for row in rows]
    return pl.DataFrame(rows, schema=schema, orient="row")


def _check_run_ids(engine: Engine, run_ids: list[str] | None) -> None:
    if run_ids is None:
        return
    known = set(runs_frame(engine)["id"].to_list())
    missing = [r for r in run_ids if r not in known]
    if missing:
        have = ", ".join(sorted(known)) or "none"
        raise DsparkError(f"no run {', '.join(map(repr, missing))} in this database (runs here: {have}). "
                          "Check the id (`--run`), or the --db file.")


def runs_frame(engine: Engine, run_ids: list[str] | None = None) -> pl.DataFrame:
    """The runs table (device_stamp and config left as JSON text)."""
    table = Run.__table__
    where = table.c.id.in_(run_ids) if run_ids is not None else None
    return _frame(engine, table, where)


def trials_frame(engine: Engine, run_ids: list[str] | None = None) -> pl.DataFrame:
    """Every trial (of `run_ids`, or all), JSON list columns parsed, with its run's machine,
    device_key and dspark_lab_version beside it. Raises DsparkError for an unknown run id."""
    _check_run_ids(engine, run_ids)
    table = Trial.__table__
    where = table.c.run_id.in_(run_ids) if run_ids is not None else None
    trials = _frame(engine, table, where)
    for name, dtype in _LIST_COLUMNS.items():
        try:
            trials = trials.with_columns(pl.col(name).str.json_decode(dtype))
        except pl.exceptions.PolarsError:
            raise DsparkError(_bad_json(trials, name)) from None
    runs = runs_frame(engine, run_ids)
    trials = trials.join(runs.select(pl.col("id").alias("run_id"), *_RUN_COLUMNS), on="run_id", how="left")
    return _with_prompt_key(_with_limit(trials, runs))


def _with_prompt_key(trials: pl.DataFrame) -> pl.DataFrame:
    """Add prompt_key, what makes two trials' prompts one across runs: the prompt's own digest
    (schema 4), so a prompt run from sets of different --prompt-limit counts once; else the set
    version (trials stored before, of a set the lab could not rebuild: lab/prompt_identity.py).

    A trial without a digest takes the digest of any trial of the same set, set version and id,
    since that is the same text: a run resumed across the upgrade, or an old run of the same
    prompt file beside a new one, then pairs and pools as it did before digests existed."""
    known = (trials.filter(pl.col("prompt_digest").is_not_null())
             .group_by(_PROMPT_IN_SET).agg(pl.col("prompt_digest").min().alias("_same_text_digest")))
    return (trials.join(known, on=_PROMPT_IN_SET, how="left")
            .with_columns(prompt_key=pl.coalesce("prompt_digest", "_same_text_digest", "prompt_set_version"))
            .drop("_same_text_digest"))


def _with_limit(trials: pl.DataFrame, runs: pl.DataFrame) -> pl.DataFrame:
    """Add limit_tok_s: the most tokens a second plain decoding could reach in that trial, the run's
    copy bandwidth over the bytes a step reads (the model's weights, and its KV cache at the
    trial's mean context: prompt plus half the output). Null where the run recorded no bandwidth
    (runs before it did, or a model it never loaded)."""
    rows = []
    for run_id, config in zip(runs["id"].to_list(), runs["config"].to_list()):
        try:
            bandwidth = json.loads(config or "{}").get("bandwidth") or {}
        except (json.JSONDecodeError, AttributeError):
            continue
        for model_id, b in (bandwidth.get("models") or {}).items():
            rows.append({"run_id": run_id, "model_id": model_id, "_bw": float(bandwidth["copy_bytes_per_s"]),
                         "_wb": float(b["weight_bytes"]), "_kv": float(b["kv_bytes_per_position"])})
    per_run = pl.DataFrame(rows, schema={"run_id": pl.String, "model_id": pl.String, "_bw": pl.Float64, "_wb": pl.Float64, "_kv": pl.Float64})
    context = pl.col("prompt_tokens") + pl.col("num_tokens") / 2
    return (trials.join(per_run, on=["run_id", "model_id"], how="left")
            .with_columns(limit_tok_s=pl.col("_bw") / (pl.col("_wb") + pl.col("_kv") * context))
            .drop("_bw", "_wb", "_kv"))


def _bad_json(trials: pl.DataFrame, column: str) -> str:
    """Name the first trial whose `column` is not a JSON list of numbers."""
    for trial_id, text in trials.select("id", column).iter_rows():
        try:
            value = json.loads(text) if text is not None else []
            if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                continue
        except json.JSONDecodeError:
            pass
        return (f"trial {trial_id!r} has a malformed {column} ({str(text)[:60]!r}); the database was edited or "
                "ingested from a damaged file. Delete that run (or re-ingest it) and report again.")
    return f"the trials table's {column} column could not be read as JSON lists of numbers."


def calibration_frame(engine: Engine) -> pl.DataFrame:
    """The calibration table (curves, options and device stamp left as JSON text)."""
    return _frame(engine, CalibrationRecord.__table__)


def cap_order(cap: str) -> tuple[int, int]:
    """Sort key for caps: "0" (baseline), 1, 2, ... numerically, then "auto"."""
    return (0, int(cap)) if str(cap).isdigit() else (1, 0)


def _bootstrap_ci(ratios: np.ndarray, n_boot: int, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the median ratio, resampling prompts with replacement."""
    if len(ratios) == 1 or n_boot <= 0:
        r = float(np.median(ratios))
        return r, r
    idx = rng.integers(0, len(ratios), size=(n_boot, len(ratios)))
    medians = np.median(ratios[idx], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def _group_seed(seed: int, key: tuple) -> list[int]:
    # Each row gets its own stream, so a row's CI does not change when other runs or arms are
    # added to (or filtered out of) the same summary.
    return [seed, zlib.crc32(json.dumps([str(k) for k in key]).encode())]


def _mean_profile(profiles: list[list[float] | None]) -> list[float]:
    """Per-position acceptance averaged over trials; position i over the trials that drafted that deep."""
    depth = max((len(p) for p in profiles if p), default=0)
    out = []
    for i in range(depth):
        vals = [p[i] for p in profiles if p and len(p) > i]
        out.append(float(np.mean(vals)))
    return out


SUMMARY_SCHEMA = {
    "machine": pl.String, "model_id": pl.String, "drafter_id": pl.String, "mode": pl.String, "cap": pl.String,
    "domain": pl.String, "trials": pl.Int64, "prompts": pl.Int64, "matched_prompts": pl.Int64,
    "median_tok_s": pl.Float64, "baseline_median_tok_s": pl.Float64, "speedup": pl.Float64,
    "ci_lo": pl.Float64, "ci_hi": pl.Float64, "mean_accept_len": pl.Float64,
    "per_position_acceptance": pl.List(pl.Float64), "lossless_trials": pl.Int64, "not_lossless_trials": pl.Int64,
    "tie_trials": pl.Int64, "unchecked_trials": pl.Int64, "run_ids": pl.List(pl.String), "device_keys": pl.List(pl.String),
    "limit_share": pl.Float64, "drafter_digests": pl.List(pl.String),
}


def _median_share(trials: pl.DataFrame) -> float | None:
    """Median over trials of decode tok/s / limit_tok_s (trials without a limit left out)."""
    if "limit_tok_s" not in trials.columns:
        return None
    share = (trials["decode_tokens_per_sec"] / trials["limit_tok_s"]).drop_nulls()
    return float(share.median()) if share.len() else None


def summary(engine: Engine, run_ids: list[str] | None = None, n_boot: int = 1000, seed: int = 0, *,
            by_domain: bool = True, trials: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per arm: (machine, model_id, drafter_id, mode, cap, domain), baselines included.

    - trials, prompts: how many generations and distinct prompts (PROMPT_KEY) the arm has;
    - median_tok_s: median decode tok/s over the arm's trials; baseline_median_tok_s: median of
      the same model's baseline trials on the prompts the arm shares with it (matched_prompts),
      from the arm's own runs where they have them;
    - speedup: median over those prompts of (arm tok/s / baseline tok/s) (the baseline of
      plain_decoding_model(model_id) where the arm's run has it: a routed copy's, its model's), each side averaged
      over its trials of that prompt in one run, the baseline taken from the same run (measured
      side by side) and, only where that run has none for the prompt, from every run on the same
      device; a prompt measured in several runs counts once, with the mean of its runs' ratios.
      A prompt is known across runs by its own content digest (prompt_key: prompt_digest), so
      sets cut by different --prompt-limit values share the prompts they both kept; trials stored
      before digests, of a set the lab could not rebuild, are known by their set's version;
      ci_lo/ci_hi: bootstrap 95% interval resampling prompts (`n_boot` resamples, deterministic
      in `seed`); null when the arm has no baseline;
    - mean_accept_len: mean of the trials' mean accept length; per_position_acceptance: d0..dk
      averaged over the trials that drafted that deep;
    - lossless_trials / not_lossless_trials / unchecked_trials: every trial counted, none dropped;
      tie_trials: those of the not-lossless ones whose first difference is a numerical tie (a logit
      gap the target's own forwards of other widths move as far: lab/lossless.py; unknown for
      trials stored before schema 2);
    - run_ids, device_keys: where the numbers come from; drafter_digests: which versions of the
      drafter's weights ran (engine/loading.weights_digest; empty where unknown);
    - limit_share: median over the arm's trials of decode tok/s over that trial's bandwidth limit
      (limit_tok_s: the plain-decoding bound; speculative arms may pass it); null for runs that
      recorded no bandwidth.

    Machine is part of the key: a speedup pooled over two machines would describe neither. The
    run is part of the pairing for the same reason: two lent machines of one class share a device
    key but not a speed (docs/performance.md, twenty-fourth and twenty-fifth rounds: greedy
    decoding 45% faster on one than on another), so an arm measured on one is compared with the
    baseline measured beside it, not with the other's.
    With by_domain=False, domain is "all" and prompts of every domain are pooled.
    `trials` reuses a frame already read with trials_frame (it is then filtered by run_ids).
    """
    df = trials if trials is not None else trials_frame(engine, run_ids)
    if trials is not None and run_ids is not None:
        df = df.filter(pl.col("run_id").is_in(run_ids))
    if not by_domain:
        df = df.with_columns(domain=pl.lit("all"))
    if df.is_empty():
        return pl.DataFrame(schema=SUMMARY_SCHEMA)

    # Mean tok/s per (arm, prompt, run); each paired with the same model's baseline on that prompt
    # in the same run, else (a run without one) with the baseline pooled over the device's runs.
    # Then one ratio per (arm, prompt): the mean over the runs that measured it.
    # A routed copy's arms (MODEL@rows-kernel) take MODEL's baseline where their run has it:
    # plain_decoding_model below.
    target = ["machine", "model_id", "domain", *PROMPT_KEY]
    per_run = df.group_by(ARM_KEY + PROMPT_KEY + ["run_id"]).agg(pl.col("decode_tokens_per_sec").mean().alias("tok_s"))
    base_trials = df.filter(pl.col("mode") == "baseline")
    base_in_run = (per_run.filter(pl.col("mode") == "baseline")
                   .select(*target, "run_id", pl.col("tok_s").alias("base_in_run")))
    base_plain = base_in_run.rename({"model_id": "plain_model_id", "base_in_run": "base_plain"})
    base_pooled = base_trials.group_by(target).agg(pl.col("decode_tokens_per_sec").mean().alias("base_pooled"))
    paired = (per_run.with_columns(plain_model_id=pl.col("model_id").map_elements(plain_decoding_model, return_dtype=pl.Utf8))
              .join(base_plain, on=["machine", "plain_model_id", "domain", *PROMPT_KEY, "run_id"], how="left")
              .join(base_in_run, on=[*target, "run_id"], how="left")
              .join(base_pooled, on=target, how="left")
              .with_columns(base_tok_s=pl.coalesce("base_plain", "base_in_run", "base_pooled"))
              .filter(pl.col("base_tok_s").is_not_null() & (pl.col("base_tok_s") > 0))
              .group_by(ARM_KEY + PROMPT_KEY)
              .agg(ratio=(pl.col("tok_s") / pl.col("base_tok_s")).mean()))

    rows = []
    for key, g in df.group_by(ARM_KEY, maintain_order=True):
        arm = dict(zip(ARM_KEY, key))
        matched = paired.filter(*[pl.col(k).eq_missing(v) for k, v in arm.items()])
        # Baseline median over the baseline trials of exactly the prompts this arm shares with it,
        # from the arm's own runs where those hold any.
        shared = base_trials.join(matched.select(PROMPT_KEY).unique(), on=PROMPT_KEY, how="semi").filter(
            (pl.col("machine") == arm["machine"]) & (pl.col("domain") == arm["domain"]))
        runs = g["run_id"].unique().to_list()
        plain = shared.filter((pl.col("model_id") == plain_decoding_model(arm["model_id"])) & pl.col("run_id").is_in(runs))
        shared = shared.filter(pl.col("model_id") == arm["model_id"])
        own = shared.filter(pl.col("run_id").is_in(runs))
        shared = plain if plain.height and arm["mode"] != "baseline" else own if own.height else shared
        speedup = ci_lo = ci_hi = None
        if arm["mode"] == "baseline":
            speedup = ci_lo = ci_hi = 1.0
        elif matched.height:
            # Sorted so the bootstrap sees prompts in a fixed order whatever order the DB returned.
            matched = matched.sort(PROMPT_KEY)
            ratios = matched["ratio"].to_numpy()
            speedup = float(np.median(ratios))
            ci_lo, ci_hi = _bootstrap_ci(ratios, n_boot, np.random.default_rng(_group_seed(seed, key)))
        lossless = g["lossless"]
        rows.append({
            **arm,
            "trials": g.height,
            "prompts": g.select(PROMPT_KEY).unique().height,
            "matched_prompts": matched.height if arm["mode"] != "baseline" else g.select(PROMPT_KEY).unique().height,
            "median_tok_s": float(g["decode_tokens_per_sec"].median()),
            "baseline_median_tok_s": (float(g["decode_tokens_per_sec"].median()) if arm["mode"] == "baseline"
                                      else float(shared["decode_tokens_per_sec"].median()) if shared.height else None),
            "speedup": speedup, "ci_lo": ci_lo, "ci_hi": ci_hi,
            "mean_accept_len": float(g["mean_accept_len"].mean()),
            "per_position_acceptance": _mean_profile(g["per_position_acceptance"].to_list()),
            "lossless_trials": int((lossless == True).sum()),  # noqa: E712 - polars comparison
            "not_lossless_trials": int((lossless == False).sum()),  # noqa: E712
            "tie_trials": int(((lossless == False) & (g["mismatch_tie"] == True)).sum()),  # noqa: E712
            "unchecked_trials": int(lossless.is_null().sum()) if arm["mode"] != "baseline" else 0,
            "run_ids": sorted(set(g["run_id"].to_list())),
            "device_keys": sorted({k for k in g["device_key"].to_list() if k is not None}),
            "limit_share": _median_share(g),
            # The versions of the drafter's weights behind the arm: more than one is two heads
            # stored at one path, pooled (the registry refuses such an arm).
            "drafter_digests": sorted({d for d in g["drafter_digest"].to_list() if d is not None}),
        })
    out = pl.DataFrame(rows, schema=SUMMARY_SCHEMA)
    order = sorted(range(out.height), key=lambda i: (
        out["machine"][i] or "", out["model_id"][i], out["domain"][i], out["mode"][i] != "baseline",
        out["mode"][i], out["drafter_id"][i] or "", cap_order(out["cap"][i])))
    return out[order]


def paired_precisions(engine: Engine, run_ids: list[str] | None = None, n_boot: int = 1000, seed: int = 0, *,
                      trials: pl.DataFrame | None = None) -> pl.DataFrame:
    """Each labelled precision of a model (MODEL@q8, @dequantized, @rows-kernel) against the model
    as given, trial by trial: for every arm (drafter, mode, cap) and domain, the median over its
    (prompt, repeat) pairs of the labelled copy's decode tok/s over the unlabelled copy's, with a
    95% bootstrap interval over the pairs. Speedups divide each copy by its own greedy decoding;
    this compares the copies' own speeds, the baseline arms included (how fast plain decoding is at
    each precision). A sweep runs a model's precisions prompt by prompt in turn, so a pair ran a
    moment apart on one machine (lab/sweep.py); from a run that swept them one after another
    (--one-precision-at-a-time, or before the fortieth round) a pair is minutes apart and says as
    much about the machine's drift. Pairs from different runs are never made.
    Columns: machine, model (as given), precision, drafter_id, mode, cap, domain, pairs, ratio,
    ci_lo, ci_hi. `trials`: an already read (or filtered) trials_frame instead of the database's."""
    from ..engine.names import AS_LOADED, split_variant

    schema = {"machine": pl.String, "model": pl.String, "precision": pl.String, "drafter_id": pl.String, "mode": pl.String,
              "cap": pl.String, "domain": pl.String, "pairs": pl.Int64, "ratio": pl.Float64, "ci_lo": pl.Float64, "ci_hi": pl.Float64}
    trials = trials_frame(engine, run_ids) if trials is None else trials
    if trials.is_empty():
        return pl.DataFrame(schema=schema)
    split = [split_variant(m) for m in trials["model_id"].to_list()]
    trials = trials.with_columns(model=pl.Series([s[0] for s in split], dtype=pl.String),
                                 precision=pl.Series([s[1] for s in split], dtype=pl.String))
    key = ["run_id", "machine", "model", "drafter_id", "mode", "cap", "domain", *PROMPT_KEY, "trial_index"]
    speed = "decode_tokens_per_sec"
    reference = trials.filter(pl.col("precision") == AS_LOADED).select(*key, pl.col(speed).alias("_ref"))
    labelled = trials.filter(pl.col("precision") != AS_LOADED).select(*key, "precision", speed)
    pairs = (labelled.join(reference, on=key, how="inner", nulls_equal=True)
             .filter(pl.col("_ref") > 0)
             .with_columns(_ratio=pl.col(speed) / pl.col("_ref")))
    rows = []
    group = ["machine", "model", "precision", "drafter_id", "mode", "cap", "domain"]
    for values, frame in pairs.group_by(group, maintain_order=True):
        ratios = frame["_ratio"].to_numpy()
        lo, hi = _bootstrap_ci(ratios, n_boot, np.random.default_rng(_group_seed(seed, values)))
        rows.append({**dict(zip(group, values)), "pairs": len(ratios), "ratio": float(np.median(ratios)), "ci_lo": lo, "ci_hi": hi})
    out = pl.DataFrame(rows, schema=schema)
    return out.sort(["machine", "model", "precision", "mode", "drafter_id", "domain"], nulls_last=True)
