"""Sweeps: a grid of models x drafters x modes x caps x prompt sets x trials, every trial stored,
device-stamped, in a DuckDB file as soon as it finishes.

For each model the sweep loads the target once (once per precision, all held at once), warms
every arm up, then walks the prompts; for each prompt it runs the baseline first and each arm
right after it, at each precision in turn, so clock drift and thermal state hit baselines,
arms and precisions alike; each later repeat rotates those orders by one place, so no arm or
precision is always the first of its cell. Each speculative output is compared with
the baseline's for the same prompt (greedy): `lossless` is stored with every trial, and a
mismatch is reported loudly and kept, never dropped.

Interrupted sweeps lose nothing: each trial is committed on its own, and `resume` re-runs only
the (arm, prompt, repeat) cells that have no stored trial.
"""

from __future__ import annotations

import hashlib
import json
import time
import tomllib
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from sqlmodel import Session, select

from ..engine.names import AS_LOADED, DEQUANTIZED, NAMED_PRECISIONS, ROWS_KERNEL, UNFUSED, plain_decoding_model, split_variant
from ..errors import DsparkError, InputError, LoadError
from ..schemas.records import Run, Trial, utcnow

MODES = ("baseline", "lookup", "dspark", "dspark-pipe", "dspark-tree", "dspark-tree-pipe", "dflash", "draft", "draft-pipe", "mlx-lm",
         "compiled-step", "plain-step")
# mlx-lm: mlx-lm's own decoder on the same model (engine/reference.py), one trial per prompt beside
# the baseline: its "speedup" is mlx-lm's rate over our greedy's, measured side by side.
# compiled-step: our plain decoding with each one-row step a compiled replay
# (greedy_generate(compiled_step=True)), its attention through engine/attention_kernel.py on CUDA
# where the kernel passes its check at the model's head layout: what `generate --mode baseline
# --attention-kernel` runs (1.10-1.14x the plain step on an H100, docs/performance.md, forty-second
# round). plain-step: our plain decoding stepping plainly, one uncompiled forward a token.
# The baseline arm itself decodes as `generate --mode baseline` does on the machine
# (SweepConfig.baseline_step), so every speedup is over the plain decoding a user gets there;
# compiled-step and plain-step show both steps beside it whichever it took.
REFERENCE_MODES = ("mlx-lm", "compiled-step", "plain-step")
# The arms that decode one token a forward and draft nothing: no cap, no acceptance, never a
# registry entry or a drafting chart's series.
NON_DRAFTING_MODES = ("baseline", *REFERENCE_MODES)
# The copy a run's bandwidth is measured with (lab/bandwidth.py): on a GPU well past its caches
# (an H200's L2 is 50 MB); on a CPU 64 MiB gives the same figure as 1 GiB in a tenth of the time.
BANDWIDTH_MIB = {"gpu": 1024, "cpu": 64}
HEAD_MODES = ("dspark", "dspark-pipe", "dspark-tree", "dspark-tree-pipe", "dflash")  # modes that need a drafter head
TREE_MODES = ("dspark-tree", "dspark-tree-pipe")  # head modes that verify trees (tree_nodes; fixed caps only)
# dspark-pipe: a DSpark head through the pipelined loop (engine/pipeline.py), head drafts only
# unless the grid sets pipe_lookup (device-side lookup drafts) or compile_draft; draft-pipe: a
# draft model through the same loop. dspark-tree: a DSpark head without a Markov term verifying a
# tree of its `tree_nodes` likeliest drafts a round (engine/tree.py); at fixed caps only (the cap
# controller's cost curves are the chain's), so its "auto" arms are not planned. dspark-tree-pipe:
# the same trees chosen and verified on the device, one round in flight (engine/tree_pipeline.py;
# the grid's compile_draft and pipe_lookup apply to it too).
DRAFT_MODES = ("draft", "draft-pipe")  # modes that need a draft model
BASELINE_STEPS = ("auto", "plain", "compiled")  # SweepConfig.baseline_step
LAUNCH_KERNELS = ("auto", "on", "off")  # SweepConfig.launch_kernels
AUTO_MAX_CAP = 8  # the cap controller's ceiling for drafters with no block size (lookup, a draft model)
# A sweep's precisions: each model also runs stored another way, made on load (no second download):
# "as-loaded", "dequantized" (a quantized model's layers as float matrices), or weight bits
# (quantized on load, groups of 64; a quantized model's layers dequantized first). Trials of a
# precision other than as-loaded carry the model id with its label, MODEL@q8 or MODEL@dequantized:
# their own baseline, speedups, cost curves and registry entry. "rows-kernel" keeps the weights as
# stored and routes their products through engine/rows_kernel.py's CUDA kernel where
# rows_kernel.worth_routing says so (MODEL@rows-kernel): beside as-loaded, the kernel side by side.
# Every precision stacks each layer's q/k/v and gate/up projections into one product each
# (engine/fused.py: the same outputs from fewer operations) except "unfused" (MODEL@unfused), the
# weights as stored with each projection its own product: the stacking side by side.
# The labels, and split_variant that reads one back, live in engine.names: the registry keys targets by them.


@dataclass
class SweepConfig:
    models: list[str]
    drafters: list[str] = field(default_factory=list)
    draft_models: list[str] = field(default_factory=list)  # small LMs with the target's tokenizer (mode draft)
    modes: list[str] = field(default_factory=lambda: ["baseline", "lookup", "dspark"])
    caps: list[str] = field(default_factory=lambda: ["2", "4", "7", "auto"])
    prompt_sets: list[str] = field(default_factory=lambda: ["code", "math", "chat"])
    trials: int = 3
    max_new_tokens: int = 200
    prompt_limit: int | None = None  # prompts per set (None: all)
    warmup: bool = True
    cooldown: float = 0.0  # seconds of sleep between arms
    drafter_bits: int = 4
    dtype: str | None = None
    launch_every: int | str = 0  # Target.launch_every for every arm, the baseline included; "auto": lab/launch_probe.py
    pipe_lookup: bool = False  # dspark-pipe arms add device-side n-gram lookup drafts (engine/pipeline.DeviceLookup)
    compile_draft: bool = False  # dspark-pipe arms draft through one compiled trace per round
    tree_nodes: int = 16  # dspark-tree arms: drafts in a round's tree
    precisions: list[str] = field(default_factory=lambda: [AS_LOADED])  # each model at each (AS_LOADED above)
    # Several precisions: held at once and run prompt by prompt in turn (_sweep_model); False: one
    # after another, one copy of the model in memory at a time.
    interleave_precisions: bool = True
    # How the baseline arm (every speedup's denominator) steps: "auto", as `generate --mode
    # baseline` does here (on CUDA the compiled one-row step through the attention kernel where
    # lab/kernel_probe.choose_greedy_step, stored per machine and model, finds it faster; else
    # plainly); "plain"; or "compiled". A resumed run keeps the step its baseline trials took.
    baseline_step: str = "auto"
    # The pipelined arms' launch-saving kernels (Target.use_launch_kernels): "auto", as `generate
    # --mode dspark-pipe` decides (on CUDA, lab/kernel_probe.choose_launch_kernels, stored per
    # machine and pair); "on" (CUDA only); "off".
    launch_kernels: str = "auto"

    def __post_init__(self) -> None:
        if not self.models:
            raise InputError("a sweep needs at least one --model.")
        self.precisions = [check_precision(p) for p in self.precisions] or [AS_LOADED]
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise InputError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}.")
        for mode in HEAD_MODES:
            if mode in self.modes and not self.drafters:
                raise InputError(f"mode {mode} needs at least one --drafter; drop {mode} from --modes or pass a head.")
        for mode in DRAFT_MODES:
            if mode in self.modes and not self.draft_models:
                raise InputError(f"mode {mode} needs at least one --draft-model (a small model with the target's tokenizer); drop {mode} from --modes or pass one.")
        for cap in self.caps:
            if cap != "auto" and not (cap.isdigit() and int(cap) >= 1):
                raise InputError(f"cap {cap!r} is not a positive number or 'auto'.")
        if self.baseline_step not in BASELINE_STEPS:
            raise InputError(f"--baseline-step {self.baseline_step!r} is not one of {', '.join(BASELINE_STEPS)}.")
        if self.launch_kernels not in LAUNCH_KERNELS:
            raise InputError(f"launch_kernels {self.launch_kernels!r} is not one of {', '.join(LAUNCH_KERNELS)}.")
        if self.launch_kernels == "on":
            from ..engine.kernels import cuda_available

            if not {"dspark-pipe", "dspark-tree-pipe"} & set(self.modes):
                raise InputError("--launch-kernels applies to modes dspark-pipe and dspark-tree-pipe, and the sweep runs neither; "
                                 "add one to --modes or leave it off.")
            if not cuda_available():
                raise InputError("--launch-kernels needs MLX's CUDA backend (the kernels are written for it), which this machine "
                                 "lacks; leave it off here.")
        if self.trials < 1 or self.max_new_tokens < 1:
            raise InputError("--trials and --max-new-tokens must be >= 1.")
        if self.cooldown < 0:
            raise InputError("--cooldown must be >= 0 seconds.")
        if self.tree_nodes < 1:
            raise InputError(f"--tree-nodes must be >= 1 (the drafts in a dspark-tree round's tree), got {self.tree_nodes}.")
        from .launch_probe import parse_launch_every

        self.launch_every = parse_launch_every(self.launch_every)

    def key(self) -> str:
        """Identity of the grid, to find an unfinished run of the same sweep to resume."""
        fields = asdict(self)
        if not fields["draft_models"]:
            del fields["draft_models"]  # grids from before draft mode keep their key, so they still resume
        if not fields["launch_every"]:
            del fields["launch_every"]  # likewise for grids from before launch_every
        for name in ("pipe_lookup", "compile_draft"):
            if not fields[name]:
                del fields[name]  # and before these
        if not set(TREE_MODES) & set(self.modes):
            del fields["tree_nodes"]  # a grid without tree arms keeps the key it had before them
        if fields["precisions"] == [AS_LOADED]:
            del fields["precisions"]
        if fields["interleave_precisions"]:
            del fields["interleave_precisions"]  # the default keeps the keys of grids from before it
        if fields["baseline_step"] == "auto":
            del fields["baseline_step"]  # likewise (such a run's baseline stepped plainly, and still does: _baseline_step)
        if fields["launch_kernels"] == "auto":
            del fields["launch_kernels"]  # likewise
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def tree_verify_rows(pipelined: bool, nodes: int, cap: str | int, max_drafts: int, lookup: bool) -> int:
    """The rows a tree arm's verify forward feeds, padding included, which the mismatch classifier's
    tree forward must match to reproduce its rounding: the plain tree loop's nodes and root, and
    with `lookup` a grafted branch padded to the head's max_drafts rows (engine/tree.tree_loop's
    width: HeadTreeSource.graft_rows); the pipelined loop's, as it computes them
    (DeviceTree.verify_rows). The sweep runs its plain tree arms with lookup, its pipelined ones
    with the grid's pipe_lookup."""
    from ..engine.tree_pipeline import DeviceTree

    if not pipelined:
        return nodes + 1 + (max_drafts if lookup else 0)
    return DeviceTree.for_cap(nodes, int(cap), max_drafts).verify_rows(lookup)


def sweep_tree_rows(mode: str, nodes: int, cap: str | int, max_drafts: int, pipe_lookup: bool) -> int:
    """tree_verify_rows for a sweep's arm of `mode` (0 for a chain arm)."""
    if mode not in TREE_MODES:
        return 0
    pipelined = mode == "dspark-tree-pipe"
    return tree_verify_rows(pipelined, nodes, cap, max_drafts, pipe_lookup if pipelined else True)


def check_precision(precision) -> str:
    """A precision as the grid names it: as-loaded, dequantized, or supported weight bits ("8")."""
    from ..engine.loading import SUPPORTED_QUANT_BITS

    name = str(precision).strip().lower()
    if name == AS_LOADED or name in NAMED_PRECISIONS or (name.isdigit() and int(name) in SUPPORTED_QUANT_BITS):
        return name
    raise InputError(f"precision {precision!r} is not one of {AS_LOADED}, {', '.join(NAMED_PRECISIONS)} or weight bits "
                     f"({', '.join(map(str, SUPPORTED_QUANT_BITS))}); e.g. --precisions {AS_LOADED},8,{DEQUANTIZED}.")


def model_variant(model: str, precision: str) -> str:
    """The model id a precision's trials carry: the model as given, or MODEL@q8 / MODEL@dequantized."""
    if precision == AS_LOADED:
        return model
    return f"{model}@{precision if precision in NAMED_PRECISIONS else 'q' + precision}"


def load_variant(model_id: str, dtype: str | None = None):
    """load_target for a model id model_variant made: the model, stored as its label says."""
    from ..engine import load_target

    path, label = split_variant(model_id)
    if label == DEQUANTIZED:
        return load_target(path, dtype=dtype, dequantize=True)
    if label == UNFUSED:
        return load_target(path, dtype=dtype, fuse_projections=False)
    if label == ROWS_KERNEL:
        from ..engine.rows_kernel import has_quantized_layers, quantized_rows_matmul

        try:
            matmul = quantized_rows_matmul()
        except RuntimeError as e:
            raise InputError(f"precision {ROWS_KERNEL}: {e}; drop it from --precisions on this machine.") from None
        target, tok = load_target(path, dtype=dtype)
        if not has_quantized_layers(target.model):
            raise InputError(f"precision {ROWS_KERNEL}: {path} has no quantized layers for the kernel; drop it from --precisions.")
        target.route_quantized_rows(matmul)
        return target, tok
    if label != AS_LOADED:
        return load_target(path, dtype=dtype, quantize=int(label[1:]))
    return load_target(path, dtype=dtype)


def load_grid(path: str | Path) -> SweepConfig:
    """A sweep grid from TOML: the same names as SweepConfig's fields."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"grid file {str(path)!r} not found.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"grid file {path}: invalid TOML ({e}).") from None
    known = set(SweepConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"grid file {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    data["caps"] = [str(c) for c in data.get("caps", SweepConfig.__dataclass_fields__["caps"].default_factory())]
    return SweepConfig(**data)


@dataclass
class Arm:
    model_id: str
    mode: str
    cap: str
    drafter_id: str | None = None
    drafter_digest: str | None = None  # which version of the drafter's weights (not part of the key)

    @property
    def key(self) -> str:
        return f"{self.model_id}|{self.drafter_id or '-'}|{self.mode}|{self.cap}"


def plan_arms(cfg: SweepConfig, model_id: str, usable: list[tuple[str, str]]) -> list[Arm]:
    """usable: the (mode, drafter) pairs that loaded for this model."""
    # The baseline always runs: speedups and the lossless check are measured against it.
    arms = [Arm(model_id, "baseline", "0")] + [Arm(model_id, mode, "0") for mode in REFERENCE_MODES if mode in cfg.modes]
    for cap in cfg.caps:
        if "lookup" in cfg.modes:
            arms.append(Arm(model_id, "lookup", cap))
        arms += [Arm(model_id, mode, cap, d) for mode, d in usable if mode in cfg.modes and not (mode in TREE_MODES and cap == "auto")]
    return arms


def _hash_ids(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]


def _trial_row(run_id, arm: Arm, trial_index, pset, prompt, cfg, r, caps_chosen, lossless, mismatch, gap, tie) -> Trial:
    decode_s = (r.num_tokens - 1) / r.decode_tokens_per_sec if r.decode_tokens_per_sec else 0.0
    return Trial(
        id=uuid.uuid4().hex, run_id=run_id, arm_key=f"{arm.key}|{pset.name}|{prompt.id}", trial_index=trial_index,
        model_id=arm.model_id, drafter_id=arm.drafter_id, mode=arm.mode, cap=arm.cap, prompt_set=pset.name,
        prompt_set_version=pset.version, prompt_id=prompt.id, prompt_digest=prompt.digest, domain=prompt.domain,
        max_new_tokens=cfg.max_new_tokens,
        output_hash=_hash_ids(r.token_ids), output_ids=json.dumps(r.token_ids), num_tokens=r.num_tokens,
        prompt_tokens=r.prompt_tokens, finish_reason=r.finish_reason, num_rounds=r.num_rounds, target_forwards=r.target_forwards,
        accept_lengths=json.dumps(r.accept_lengths), draft_lengths=json.dumps(r.draft_lengths),
        per_position_acceptance=json.dumps(r.per_position_acceptance()),
        caps_chosen=json.dumps(caps_chosen) if caps_chosen is not None else None,
        mean_accept_len=r.mean_accept_len, prefill_seconds=r.prefill_seconds, decode_seconds=decode_s,
        tokens_per_sec=r.tokens_per_sec, decode_tokens_per_sec=r.decode_tokens_per_sec, lossless=lossless, mismatch_index=mismatch,
        mismatch_gap=gap, mismatch_tie=tie, drafter_digest=arm.drafter_digest,
    )


# How a trial's message begins when its output differs from the baseline's (printed in colour
# by the sweep itself, so a caller's on_event may skip it).
MISMATCH_WORDS = ("NOT LOSSLESS", "differs at a tie")


def _classify_mismatch(target, tok, prompt, ref: list[int], out: list[int], cap: str,
                       tree_width: int = 0) -> tuple[float | None, bool | None, str]:
    """(gap, tie, words) for a trial whose output differs from the baseline's: the logit gap of
    the two competing tokens at the first difference, and whether forwards of other widths move
    that gap by as much (a numerical tie: low-precision kernels of different widths may break it
    either way; lab/lossless.py) or not (a real divergence, which a lossless engine must never show).
    `tree_width`: a tree arm's verify rows, for a tree forward among the widths."""
    from ..engine.text import encode_prompt
    from .lossless import first_divergence, verify_width

    d = first_divergence(target, encode_prompt(tok, prompt.as_input()), ref, out, width=verify_width(cap), tree_width=tree_width)
    if d is None or d.get("length_differs"):
        return None, False, "the outputs differ in length"
    kind = "a numerical tie" if d["tie"] else "a REAL divergence"
    return d["gap"], d["tie"], f"{kind} (logits {d['logit_a']} vs {d['logit_b']} in {d['logit_dtype'].rsplit('.', 1)[-1]}: {d['why']})"


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def find_resumable(engine, cfg: SweepConfig) -> str | None:
    """The newest unfinished run of the same grid in this database, if any."""
    with Session(engine) as s:
        runs = s.exec(select(Run).where(Run.status != "finished").order_by(Run.started_at.desc())).all()
    for run in runs:
        if json.loads(run.config).get("key") == cfg.key():
            return run.id
    return None


def run_sweep(
    cfg: SweepConfig,
    db_path: str | Path,
    *,
    resume: bool | str = False,
    progress: bool = True,
    on_event: Callable[[str], None] | None = None,
) -> str:
    """Run (or resume) a sweep into `db_path`; returns the run id."""
    from .device import collect_device_stamp, device_key, machine_class
    from .prompt_identity import open_with_digests
    from .prompts import load_prompt_sets

    say = on_event or (lambda _m: None)
    sets = load_prompt_sets(cfg.prompt_sets, limit=cfg.prompt_limit)
    _check_paths(cfg)
    engine = open_with_digests(db_path)  # older runs in this file pool with this one by prompt digest
    pipe_options = {k: True for k in ("pipe_lookup", "compile_draft") if getattr(cfg, k)}
    if set(TREE_MODES) & set(cfg.modes):
        pipe_options["tree_nodes"] = cfg.tree_nodes
    stamp = collect_device_stamp({"drafter_bits": cfg.drafter_bits, "dtype": cfg.dtype, "max_new_tokens": cfg.max_new_tokens,
                                  **({"launch_every": cfg.launch_every} if cfg.launch_every else {}), **pipe_options})
    from ..engine.loading import weights_digest

    try:  # a refusal here (no such run, a changed head) leaves the file closed for the caller
        run_id = resume if isinstance(resume, str) else (find_resumable(engine, cfg) if resume else None)
        # Which version of each drafter's weights this run measures: stored on every trial, and a
        # resumed run refuses drafters that hold other weights than it measured.
        digests = {d: weights_digest(d) for d in [*cfg.drafters, *cfg.draft_models]}
        with Session(engine) as s:
            if run_id is not None:
                run = s.get(Run, run_id)
                if run is None:
                    raise DsparkError(f"no run {run_id!r} in {db_path} to resume.")
                check_same_drafters(s, run_id, digests)
                run.status = "running"
                s.add(run)
            else:
                from .. import __version__

                run_id = uuid.uuid4().hex[:12]
                # The copy bandwidth, measured once a run, and each model's bytes a decode step reads
                # (added as each loads: _note_decode_bytes) put every trial against the bandwidth limit.
                bandwidth = {"copy_bytes_per_s": _measure_bandwidth(), "models": {}}
                s.add(Run(id=run_id, dspark_lab_version=__version__, device_key=device_key(stamp), machine=machine_class(stamp),
                          device_stamp=json.dumps(stamp, default=str),
                          config=json.dumps({**asdict(cfg), "key": cfg.key(), "prompt_set_versions": {p.name: p.version for p in sets},
                                             "bandwidth": bandwidth, "baseline_step_chosen": {}})))
            s.commit()
            done = {(t.arm_key, t.trial_index) for t in s.exec(select(Trial).where(Trial.run_id == run_id)).all()}
    except BaseException:
        engine.dispose()
        raise
    say(f"run {run_id}: {len(done)} trials already stored")

    status = "interrupted"
    try:
        for model in cfg.models:
            _sweep_model(cfg, model, sets, engine, run_id, done, progress, say, digests)
        status = "finished"
    except Exception:
        status = "failed"
        raise
    finally:
        with Session(engine) as s:
            run = s.get(Run, run_id)
            run.status, run.finished_at = status, utcnow()
            s.add(run)
            s.commit()
        engine.dispose()
    return run_id


def _check_paths(cfg: SweepConfig) -> None:
    """A model, head or draft model that is neither a folder here nor a Hugging Face repo id is a
    typo: say so before a run is created, not after it was started and failed (a head that does
    not load for one model of a grid is skipped with a message instead: it may be another's)."""
    from ..engine.loading import check_reference

    for what, refs in (("model", cfg.models), ("drafter", cfg.drafters), ("draft model", cfg.draft_models)):
        for ref in refs:
            try:
                check_reference(ref, what=what)
            except LoadError as e:
                raise InputError(f"{e} (nothing was run or stored)") from None


def check_same_drafters(session: Session, run_id: str, digests: dict[str, str | None]) -> None:
    """Refuse to resume a run whose drafters now hold other weights than the run measured (a head
    continued and stored again at the same path): its trials and the new ones would be summed up
    as one arm, a speed and an acceptance that neither head has."""
    stored = session.exec(select(Trial.drafter_id, Trial.drafter_digest).where(Trial.run_id == run_id)
                          .where(Trial.drafter_digest.is_not(None)).distinct()).all()
    for drafter, then in stored:
        now = digests.get(drafter, then)
        if now != then:
            raise DsparkError(
                f"drafter {drafter!r} holds other weights than run {run_id} measured (weights digest {then} then, "
                f"{now or 'none: not a local folder'} now); resuming would pool two versions' trials as one arm. "
                "Put the measured version back to resume, or start a new run (without --resume) to measure this one.")


def _sweep_model(cfg, model, sets, engine, run_id, done, progress, say, digests):
    """One model of the grid at each of its precisions. With several and cfg.interleave_precisions
    (the default), every precision is loaded at once and each prompt runs at every precision
    before the next prompt. Run one after another, two precisions can meet two different
    machines: an H100's greedy decoding of one prompt ran 178 and 324 tok/s a minute apart, and the
    precision swept second read its speedups over the slower one (fortieth round). Otherwise one
    precision after another, one copy of the model in memory at a time."""
    ids = [model_variant(model, p) for p in cfg.precisions]
    for group in ([ids] if cfg.interleave_precisions else [[i] for i in ids]):
        variants = [_prepare_variant(cfg, model_id, engine, run_id, digests, say) for model_id in group]
        _run_cells(cfg, variants, sets, engine, run_id, done, progress, say)
        del variants  # before the next group loads: one precision's weights at a time


@dataclass
class _Variant:
    """A model at one precision, ready to run its arms: target, tokenizer, loaded drafters, arms,
    and generate(arm, prompt_input, max_new) -> (result, caps chosen)."""

    model_id: str
    target: object
    tok: object
    drafters: dict
    arms: list
    generate: Callable


def _prepare_variant(cfg, model_id, engine, run_id, digests, say) -> _Variant:
    from ..engine import draft_model_generate, greedy_generate, load_target, lookup_generate, mlx_lm_generate, speculative_generate
    from ..engine.drafters.load import load_dflash, load_dspark
    from ..engine.speculative import check_pipeline_target, check_same_tokenizer
    from ..engine.tree import check_tree
    from .calibrate import calibrate
    from .controller import DEFAULT_ACCEPTANCE, CapController

    target, tok = load_variant(model_id, cfg.dtype)
    _note_decode_bytes(engine, run_id, model_id, target)
    if cfg.launch_every == "auto":
        from .launch_probe import choose_launch_every

        caps = [int(c) for c in cfg.caps if c.isdigit()]
        verdict = choose_launch_every(target, db=engine, model_id=model_id, width=min(max(caps, default=4), 7) + 1)
        say(f"{model_id}: {verdict.describe()}")
        target.launch_every = verdict.every
        # The run says what "auto" became, so an exported result carries it with its trials.
        _note_chosen(engine, run_id, "launch_every_chosen", model_id, verdict.to_dict())
    else:
        target.launch_every = cfg.launch_every
    baseline_compiled = _baseline_step(cfg, target, tok, engine, run_id, model_id, say)
    if baseline_compiled or "compiled-step" in cfg.modes:
        _route_step_attention(target, engine, run_id, model_id, say)
    drafters = {}  # (mode, drafter id) -> loaded head
    loaders = {"dspark": load_dspark, "dspark-pipe": load_dspark, "dspark-tree": load_dspark, "dspark-tree-pipe": load_dspark,
               "dflash": load_dflash}
    modes = [m for m in HEAD_MODES if m in cfg.modes]
    piped = [m for m in ("dspark-pipe", "dspark-tree-pipe") if m in modes]
    if piped:
        try:
            check_pipeline_target(target)
        except DsparkError as e:
            for mode in piped:
                say(f"skipping mode {mode} for {model_id}: {e}")
                modes.remove(mode)
    for mode in modes:
        for d in cfg.drafters:
            try:
                if mode in ("dspark-pipe", *TREE_MODES) and ("dspark", d) in drafters:
                    drafters[(mode, d)] = drafters[("dspark", d)]  # the same head; each generation resets its state
                else:
                    drafters[(mode, d)] = loaders[mode](d, target, bits=cfg.drafter_bits)
                if mode in TREE_MODES:
                    check_tree(target, drafters[(mode, d)])
            except DsparkError as e:  # a head of the other kind, or for another model in a multi-model grid; one with a Markov term
                drafters.pop((mode, d), None)
                say(f"skipping drafter {d} for {model_id} in mode {mode}: {e}")
    piped_heads = [(d, h) for (m, d), h in drafters.items() if m in ("dspark-pipe", "dspark-tree-pipe")]
    if piped_heads:  # keyed as generate keys it, so either finds the other's verdict
        d, head = piped_heads[0]
        _route_launch_kernels(cfg.launch_kernels, target, head, tok, engine, run_id, f"{model_id}|{d}|{cfg.drafter_bits}", say)
    draft_modes = [m for m in DRAFT_MODES if m in cfg.modes]
    if draft_modes:
        for d in cfg.draft_models:  # loaded once per target, like the heads; both modes share it
            try:
                drafter, draft_tok = load_target(d, dtype=cfg.dtype)
                check_same_tokenizer(tok, draft_tok, drafter, model=model_id, draft_model=d)
            except LoadError as e:  # another family's tokenizer, in a multi-model grid
                say(f"skipping draft model {d} for {model_id}: {e}")
                continue
            for mode in draft_modes:
                if mode == "draft-pipe":
                    try:
                        check_pipeline_target(target)
                        check_pipeline_target(drafter)
                    except DsparkError as e:
                        say(f"skipping mode draft-pipe for {model_id} with {d}: {e}")
                        continue
                drafters[(mode, d)] = drafter
                if mode == "draft-pipe":
                    _route_draft_attention(drafter, target, tok, engine, run_id, f"{model_id}|{d}", say)
    arms = plan_arms(cfg, model_id, list(drafters))
    for arm in arms:
        arm.drafter_digest = digests.get(arm.drafter_id)
    curves_for = {}  # arm key -> calibrated cost curves, for cap "auto"

    def generate(arm: Arm, prompt_input, max_new):
        ctrl = None
        if arm.cap == "auto":
            if arm.key not in curves_for:
                curves_for[arm.key] = calibrate(target, drafters.get((arm.mode, arm.drafter_id)), mode=arm.mode, model_id=model_id,
                                                drafter_id=arm.drafter_id, db=engine,
                                                compile_draft=cfg.compile_draft and arm.mode == "dspark-pipe",
                                                lookup_drafts=cfg.pipe_lookup and arm.mode == "dspark-pipe").curves
            max_cap = drafters[(arm.mode, arm.drafter_id)].config.max_drafts if arm.mode in HEAD_MODES else AUTO_MAX_CAP
            # A fresh controller per generation: each trial's cap choices depend on that trial alone.
            ctrl = CapController(curves_for[arm.key], max_cap=max_cap, prior=DEFAULT_ACCEPTANCE[arm.mode])
        cap = 0 if arm.cap in ("0", "auto") else int(arm.cap)
        if arm.mode in ("baseline", "plain-step"):
            r = greedy_generate(target, tok, prompt_input, max_new_tokens=max_new, compiled_step=arm.mode == "baseline" and baseline_compiled)
        elif arm.mode == "mlx-lm":
            r = mlx_lm_generate(target, tok, prompt_input, max_new_tokens=max_new)
        elif arm.mode == "compiled-step":
            r = greedy_generate(target, tok, prompt_input, max_new_tokens=max_new, compiled_step=True)
        elif arm.mode == "lookup":
            r = lookup_generate(target, tok, prompt_input, max_new_tokens=max_new, max_draft_tokens=cap or 8, cap_controller=ctrl)
        elif arm.mode in DRAFT_MODES:
            r = draft_model_generate(target, tok, drafters[(arm.mode, arm.drafter_id)], prompt_input, max_new_tokens=max_new,
                                     pipeline=arm.mode == "draft-pipe",
                                     max_draft_tokens=cap or AUTO_MAX_CAP, cap_controller=ctrl)
        else:
            d = drafters[(arm.mode, arm.drafter_id)]
            r = speculative_generate(target, tok, d, prompt_input, max_new_tokens=max_new,
                                     max_draft_tokens=min(cap, d.config.max_drafts) if cap else 2, cap_controller=ctrl,
                                     **pipe_kwargs(arm.mode))
        return r, (ctrl.history if ctrl is not None else None)

    def pipe_kwargs(mode: str) -> dict:
        """The loop a head arm runs: plain, or pipelined with the grid's dspark-pipe options."""
        if mode == "dspark-tree":
            return {"pipeline": False, "tree_nodes": cfg.tree_nodes}
        if mode == "dspark-tree-pipe":
            return {"pipeline": True, "tree_nodes": cfg.tree_nodes, "lookup_drafts": cfg.pipe_lookup, "compile_draft": cfg.compile_draft}
        if mode != "dspark-pipe":
            return {"pipeline": False}
        return {"pipeline": True, "lookup_drafts": cfg.pipe_lookup, "compile_draft": cfg.compile_draft}

    return _Variant(model_id, target, tok, drafters, arms, generate)


def _note_chosen(engine, run_id: str, what: str, key: str, verdict: dict) -> None:
    """Store in the run's config what a probe chose for `key` (a model, a pair), so an exported
    result carries it with the trials it shaped."""
    with Session(engine) as s:
        run = s.get(Run, run_id)
        config = json.loads(run.config)
        config.setdefault(what, {})[key] = verdict
        run.config = json.dumps(config)
        s.add(run)
        s.commit()


def _baseline_step(cfg, target, tok, engine, run_id: str, model_id: str, say) -> bool:
    """Whether this model's baseline arm steps compiled (cfg.baseline_step): a run resumed keeps
    the step it chose before (a run from before the choice was recorded stepped plainly); "auto"
    asks what `generate --mode baseline` asks on CUDA (kernel_probe.choose_greedy_step, stored per
    machine and model: plain decoding timed both ways), and steps plainly elsewhere; a routed copy
    (MODEL@rows-kernel) steps as MODEL's baseline did where the run measured MODEL first. The
    choice goes in the run's config as baseline_step_chosen."""
    from ..engine.kernels import cuda_available

    with Session(engine) as s:
        chosen = json.loads(s.get(Run, run_id).config).get("baseline_step_chosen")
    if chosen is None:
        say(f"{model_id}: the baseline steps plainly, as this run's stored baseline trials did")
        return False
    if model_id in chosen:
        return chosen[model_id]["step"] == "compiled"
    model = plain_decoding_model(model_id)
    if model != model_id and model in chosen:
        # A routed copy's one-row step is its model's: probing it again only draws another sample
        # of the machine's noise (engine.names.plain_decoding_model says why and what it cost).
        step = chosen[model]["step"]
        say(f"{model_id}: the baseline steps as {model}'s does ({step}): at one row the routed layers run their own product")
        _note_chosen(engine, run_id, "baseline_step_chosen", model_id, {"step": step, "asked": cfg.baseline_step, "as": model})
        return step == "compiled"
    verdict = None
    if cfg.baseline_step == "auto" and cuda_available():
        from .kernel_probe import choose_greedy_step

        verdict = choose_greedy_step(target, tokenizer=tok, db=engine, model_id=model_id)
        compiled = verdict.use
        why = f"as generate --mode baseline does here: {verdict.describe()}"
    else:
        compiled = cfg.baseline_step == "compiled"
        why = "as asked" if cfg.baseline_step != "auto" else "as generate --mode baseline does off CUDA"
    step = "compiled" if compiled else "plain"
    say(f"{model_id}: the baseline steps {'through the compiled one-row step' if compiled else 'plainly'}, {why}")
    _note_chosen(engine, run_id, "baseline_step_chosen", model_id,
                 {"step": step, "asked": cfg.baseline_step, **({"probe": verdict.to_dict()} if verdict else {})})
    return compiled


def _route_step_attention(target, engine, run_id: str, model_id: str, say) -> None:
    """For a compiled step (the compiled-step arm, a compiled baseline), on CUDA: the target's
    one-row array-offset attention through engine/attention_kernel.py where the kernel passes its
    check at the model's head layout (the arms themselves time it); the check goes in the run's
    config. Other arms run a one-row forward at an array offset only where a pipelined loop's cap
    is 0."""
    from ..engine.kernels import cuda_available

    if not cuda_available():
        return
    from ..engine import attention_kernel
    from .kernel_probe import measure_greedy_step

    from ..engine.cache_kernels import cache_writer_here

    verdict = measure_greedy_step(target)  # the check alone: the sweep's own arms do the timing
    say(f"{model_id}: the compiled-step arm's attention through {'the kernel' if verdict.exact else 'MLX'}: {verdict.reason}")
    if verdict.exact:
        target.route_attention(attention_kernel.rows_attention())
        target.write_cache_with(cache_writer_here())  # as generate --mode baseline steps
    _note_chosen(engine, run_id, "step_attention_checked", model_id, verdict.to_dict())


def _route_launch_kernels(setting: str, target, head, tok, engine, run_id: str, pair: str, say) -> None:
    """On CUDA, the pipelined loops' launch-saving kernels (Target.use_launch_kernels): with `setting`
    "auto" where the probe (stored per machine and pair, as `generate --mode dspark-pipe` finds it)
    says they are exact and faster, so the sweep's pipelined arms measure what generate runs; "on"
    or "off" as told (SweepConfig refused "on" off CUDA). They reach every array-offset forward of
    the target, a compiled baseline's one-row step too; the verdict goes in the run's config."""
    from ..engine.kernels import cuda_available

    if not cuda_available():
        return
    from .kernel_probe import choose_launch_kernels, launch_kernels

    if setting == "off":
        _note_chosen(engine, run_id, "launch_kernels_chosen", pair, {"use": False, "reason": "--no-launch-kernels given"})
        return
    if setting == "on":
        use, said = True, {"use": True, "reason": "--launch-kernels given"}
        say(f"{pair}: launch kernels on, as given")
    else:
        verdict = choose_launch_kernels(target, db=engine, loop=(head, tok), model_id=pair)
        say(f"{pair}: {verdict.describe()}")
        use, said = verdict.use, verdict.to_dict()
    if use:
        target.use_launch_kernels(launch_kernels())
        head.drop_traces()
    _note_chosen(engine, run_id, "launch_kernels_chosen", pair, said)


def _route_draft_attention(drafter, target, tok, engine, run_id: str, pair: str, say) -> None:
    """On CUDA, the draft model's one-row attention through engine/attention_kernel.py where the
    probe (stored per machine and pair, as `generate --mode draft-pipe` finds it) says it is exact
    and faster: the sweep's draft-pipe arms measure what generate runs. It changes only the
    drafts (the plain draft mode's forwards are never routed); the verdict goes in the run's config."""
    from ..engine.kernels import cuda_available

    if not cuda_available():
        return
    from ..engine import attention_kernel
    from .kernel_probe import choose_attention_kernel

    verdict = choose_attention_kernel(drafter, db=engine, loop=(target, tok), model_id=pair)
    say(f"{pair}: {verdict.describe()}")
    if verdict.use:
        drafter.route_attention(attention_kernel.rows_attention())
    _note_chosen(engine, run_id, "attention_kernel_chosen", pair, verdict.to_dict())


def _run_cells(cfg, variants: list[_Variant], sets, engine, run_id, done, progress, say) -> None:
    """Every prompt x repeat cell, each variant's arms in turn, each trial stored as it finishes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cells = [(p, prompt, i) for p in sets for prompt in p.prompts for i in range(cfg.trials)]

    def waiting(v: _Variant, pset, prompt, i) -> list[Arm]:
        return [a for a in v.arms if (f"{a.key}|{pset.name}|{prompt.id}", i) not in done]

    todo = sum(len(waiting(v, *c)) for c in cells for v in variants)
    if not todo:
        return
    if cfg.warmup:  # every arm once on a short generation: compiles kernels, fills caches
        first = sets[0].prompts[0].as_input()
        for v in variants:
            if any(waiting(v, *c) for c in cells):
                for arm in v.arms:
                    v.generate(arm, first, min(16, cfg.max_new_tokens))

    baseline_ids: dict[tuple[str, str, str], list[int]] = {}
    name = variants[0].model_id.split("/")[-1] + (f" at {len(variants)} precisions" if len(variants) > 1 else "")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), disable=not progress, transient=False) as bar:
        task = bar.add_task(f"sweep {name}", total=todo)
        for pset, prompt, i in cells:
            # Later repeats rotate the precisions' order too, so none is always run first.
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            ran = 0
            for v in order:
                cell_arms = waiting(v, pset, prompt, i)
                if not cell_arms:
                    continue
                ref_key = (v.model_id, pset.name, prompt.id)
                # Trial 0 runs the baseline first: its tokens are the reference every arm is checked
                # against. Later trials rotate the order by one place each, so whatever the first arm
                # of a cell pays (a new prompt's allocations, the device settling after the last arm)
                # does not land on the baseline every time and bias every speedup.
                if i and len(cell_arms) > 1:
                    cell_arms = cell_arms[i % len(cell_arms):] + cell_arms[:i % len(cell_arms)]
                for arm in cell_arms:
                    if ran and cfg.cooldown:
                        time.sleep(cfg.cooldown)
                    ran += 1
                    r, caps_chosen = v.generate(arm, prompt.as_input(), cfg.max_new_tokens)
                    lossless = mismatch = gap = tie = None
                    if arm.mode == "baseline":
                        baseline_ids[ref_key] = r.token_ids
                    else:
                        ref = baseline_ids.get(ref_key)
                        if ref is None:  # resumed after the baseline was stored: compare with the stored one
                            ref = stored_baseline(engine, run_id, v.model_id, pset.name, prompt.id)
                        if ref is not None:
                            lossless, mismatch, gap, tie = _check_against_baseline(cfg, v, arm, pset, prompt, ref, r.token_ids, bar, say)
                    row = _trial_row(run_id, arm, i, pset, prompt, cfg, r, caps_chosen, lossless, mismatch, gap, tie)
                    cell = (row.arm_key, i)
                    with Session(engine) as s:  # one commit per trial: a kill loses at most the one in flight
                        s.add(row)
                        s.commit()
                    done.add(cell)
                    bar.advance(task)
                    say(f"stored trial {len(done)}: {arm.key} {pset.name}/{prompt.id} #{i}")


def _check_against_baseline(cfg, v: _Variant, arm: Arm, pset, prompt, ref: list[int], out: list[int], bar, say):
    """(lossless, first mismatch, logit gap, tie) of an arm's tokens against its baseline's; a
    difference is classified (a numerical tie or a real divergence) and said loudly, in colour."""
    mismatch = _first_mismatch(ref, out)
    if mismatch is None:
        return True, None, None, None
    rows = sweep_tree_rows(arm.mode, cfg.tree_nodes, arm.cap, v.drafters[(arm.mode, arm.drafter_id)].config.max_drafts,
                           cfg.pipe_lookup) if arm.mode in TREE_MODES else 0
    gap, tie, why = _classify_mismatch(v.target, v.tok, prompt, ref, out, arm.cap, rows)
    msg = (f"{MISMATCH_WORDS[1] if tie else MISMATCH_WORDS[0]}: {arm.key} on {pset.name}/{prompt.id} "
           f"differs from baseline at token {mismatch}: {why}")
    bar.console.print(f"[bold {'yellow' if tie else 'red'}]{msg}[/]")
    say(msg)
    return False, mismatch, gap, tie


def _measure_bandwidth() -> float:
    """This device's copy bandwidth in bytes a second (lab/bandwidth.py), over BANDWIDTH_MIB."""
    import mlx.core as mx

    from .bandwidth import copy_bandwidth

    return copy_bandwidth(BANDWIDTH_MIB["gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"])


def _note_decode_bytes(engine, run_id: str, model_id: str, target) -> None:
    """Store in the run's config what one decode step of this model reads (weights, KV per position)."""
    from .bandwidth import decode_bytes

    weights, kv = decode_bytes(target)
    with Session(engine) as s:
        run = s.get(Run, run_id)
        config = json.loads(run.config)
        if "bandwidth" not in config:  # a run begun before the limit was recorded: nothing to put it against
            return
        config["bandwidth"]["models"][model_id] = {"weight_bytes": weights, "kv_bytes_per_position": kv}
        run.config = json.dumps(config)
        s.add(run)
        s.commit()


def stored_baseline(engine, run_id, model_id, set_name, prompt_id) -> list[int] | None:
    """The token ids of a run's stored baseline trial of this model and prompt (the reference a
    resumed sweep, or a recheck, compares with); None when none is stored."""
    with Session(engine) as s:
        row = s.exec(select(Trial).where(Trial.run_id == run_id, Trial.model_id == model_id, Trial.mode == "baseline",
                                         Trial.prompt_set == set_name, Trial.prompt_id == prompt_id)).first()
    return json.loads(row.output_ids) if row is not None else None
