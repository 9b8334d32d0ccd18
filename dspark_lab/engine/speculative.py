"""Speculative decoding with a model drafter: a head (`load_pair`, `speculative_generate`) or a
small language model sharing the target's tokenizer (`load_draft_pair`, `draft_model_generate`)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from ..errors import InputError, LoadError, MeasuredVersionWarning, PlainIsFaster
from .drafters.lookup import LookupConfig, NgramIndex
from .generate import Draft, DraftSource, GenResult, _setup, cap_schedule, speculative_loop
from .loading import load_target, quantization_entry, read_model_config, weights_digest
from .names import ROWS_KERNEL
from .target import Target
from .text import TextStream

# A lookup match this long (prompt/output n-gram) is trusted over the drafter for the round;
# the index looks up suffixes up to LOOKUP_MAX_MATCH long, the longest first.
LOOKUP_MIN_MATCH = 3
LOOKUP_MAX_MATCH = 4
LOOKUP_NS = tuple(range(LOOKUP_MAX_MATCH, LOOKUP_MIN_MATCH - 1, -1))  # the n-gram lengths the device-side lookup tries, longest first


class HeadSource(DraftSource):
    """Drafts from a model head (DSpark, DFlash); when the n-gram index finds a long match,
    verifies that continuation instead (free, and often longer). Every committed row's taps go
    to the head's context either way, so the head stays in step with the target."""

    def __init__(self, drafter, *, lookup: bool = True, confidence_threshold: float = 0.0):
        self.drafter = drafter
        self.taps = drafter.target_layer_ids
        self.lookup = lookup
        self.threshold = confidence_threshold
        self.index: NgramIndex | None = None
        self.extra_reads = 0  # host reads spent on confidence truncation

    def start(self, prompt_ids, prompt_taps):
        self.drafter.reset()
        self.drafter.append_context(prompt_taps)
        if self.lookup:
            self.index = NgramIndex(prompt_ids, LookupConfig(min_n=LOOKUP_MIN_MATCH, max_n=LOOKUP_MAX_MATCH, max_draft=self.drafter.config.max_drafts))

    def propose(self, pending, cap, params):
        if cap <= 0:
            return Draft([])
        if self.index is not None:
            hit = self.index.propose(cap)
            if hit:
                return Draft(hit)
        out = self.drafter.draft(pending, cap, params)
        if self.threshold > 0 and out.survival is not None:
            # Truncating changes the verify width, which the host must know: one extra read.
            keep = mx.cumprod((out.survival >= self.threshold).astype(mx.int32)).sum().item()
            self.extra_reads += 1
            return Draft(out.tokens[:keep], out.probs[:keep] if out.probs is not None else None)
        return Draft(out.tokens, out.probs)

    def commit(self, tokens, taps):
        if self.index is not None:
            self.index.extend(tokens)
        if taps:
            self.drafter.append_context(taps)


def speculative_generate(
    target: Target,
    tokenizer,
    drafter,
    prompt: str | Sequence[int] | list[dict],
    *,
    max_new_tokens: int = 256,
    max_draft_tokens: int = 2,
    cap_controller=None,
    lookup_drafts: bool | None = None,
    confidence_threshold: float = 0.0,
    pipeline: bool = False,
    compile_draft: bool = False,
    lookup_kernel: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    on_text: Callable[[str], None] | None = None,
    apply_chat_template: bool = True,
    tree_nodes: int = 0,
) -> GenResult:
    """Speculative decoding with a model head (DSpark, or DFlash): each round drafts up to
    `max_draft_tokens` (or what `cap_controller` chooses), verifies them in one target forward
    and keeps exactly what the target would have produced.

    `lookup_drafts` (default on, off when pipelined): a long n-gram match in prompt and output
    is verified instead of the head's draft. `pipeline`: build each round while the previous
    one computes (engine/pipeline.py), on targets with plain KV caches; with `lookup_drafts=True`
    the n-gram match runs on the device and its tokens replace the head's slot by slot, and
    `compile_draft=True` drafts through one compiled trace per round (in the chain: greedy only;
    off until measured faster on a GPU). `lookup_kernel=True` runs that device-side lookup as one
    custom CUDA kernel (engine/kernels.py; lab/kernel_probe.py says whether it is exact and faster
    here). `tree_nodes=N` (DSpark heads without a Markov term): each round verifies a tree of the
    head's N likeliest drafts, at most `max_draft_tokens` deep, instead of one chain
    (engine/tree.py), with a long n-gram match's continuation grafted on as one more path unless
    lookup_drafts is False; not with confidence truncation. With `pipeline` (a fixed cap) the tree
    is chosen and verified (greedy, or by the sampled walk) on the device, one round in flight
    (engine/tree_pipeline.py); there lookup drafts are off unless lookup_drafts=True, and then
    matched on the device."""
    params, prompt_ids = _setup(target, tokenizer, prompt, max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template)
    limit = drafter.config.max_drafts
    if cap_controller is None and not 1 <= max_draft_tokens <= limit:
        raise InputError(f"max_draft_tokens must be in 1..{limit} for this head (block_size {drafter.config.block_size}), got {max_draft_tokens}.")
    if not 0.0 <= confidence_threshold < 1.0:
        raise InputError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}.")
    if confidence_threshold > 0 and not getattr(drafter.config, "enable_confidence_head", False):
        raise InputError("confidence_threshold needs a head with a confidence head; this one has none. Leave it at 0.")
    cap, on_round = cap_schedule(cap_controller, max_draft_tokens, limit)
    if (compile_draft or lookup_kernel) and not pipeline:
        what = "compile_draft" if compile_draft else "lookup_kernel"
        raise InputError(f"{what} is a pipelined-loop option: pass pipeline=True with it (or --mode dspark-pipe).")
    if tree_nodes:
        from .tree import HeadTreeSource, check_tree, tree_loop

        if tree_nodes < 0:
            raise InputError(f"tree_nodes must be >= 0 (0: one chain of drafts a round), got {tree_nodes}.")
        if confidence_threshold > 0:
            raise InputError("tree_nodes cannot be combined with confidence_threshold: a tree keeps every candidate it "
                             "verifies. Drop one of them.")
        check_tree(target, drafter)
        if pipeline:
            from .tree_pipeline import tree_pipelined_loop

            why = [what for what, bad in (("a cap controller", cap_controller is not None),
                                          ("the lookup kernel", lookup_kernel)) if bad]
            if why:
                raise InputError(f"pipelined tree drafts run at a fixed cap, with the lookup in MLX operations; this run "
                                 f"asks for {', '.join(why)}. Run the tree without pipeline (it takes a cap controller), "
                                 "or drop them.")
            check_pipeline(target, drafter)
            # As in the pipelined chain, lookup drafts are off unless asked (matched on the device).
            return tree_pipelined_loop(target, prompt_ids, params, drafter, nodes=tree_nodes, max_new_tokens=max_new_tokens,
                                       cap=max_draft_tokens, stream=TextStream(tokenizer, stop, on_text), on_round=on_round,
                                       compile_draft=compile_draft, lookup_n=LOOKUP_NS if lookup_drafts else ())
        source = HeadTreeSource(drafter, lookup=lookup_drafts is not False)  # a match's continuation joins the tree
        return tree_loop(target, prompt_ids, params, source, nodes=tree_nodes,
                         max_new_tokens=max_new_tokens, cap=cap, stream=TextStream(tokenizer, stop, on_text), on_round=on_round)
    if pipeline:
        check_pipeline(target, drafter, confidence_threshold=confidence_threshold)
        from .pipeline import pipelined_loop

        # Off unless asked: the device-side lookup is not yet measured on a GPU.
        lookup_n = LOOKUP_NS if lookup_drafts else ()
        kernel = None
        if lookup_kernel:
            from .kernels import ngram_lookup_kernel

            if not lookup_n:
                raise InputError("lookup_kernel runs the device-side lookup: pass lookup_drafts=True with it (or leave it off).")
            try:
                kernel = ngram_lookup_kernel(lookup_n)
            except RuntimeError as e:
                raise InputError(f"lookup_kernel cannot run here: {e}. Leave it off (the MLX operations give the same drafts).") from None
        return pipelined_loop(target, prompt_ids, params, drafter, max_new_tokens=max_new_tokens, cap=cap,
                              stream=TextStream(tokenizer, stop, on_text), mode="dspark-pipe", on_round=on_round,
                              lookup_n=lookup_n, compile_draft=compile_draft, lookup_kernel=kernel)
    source = HeadSource(drafter, lookup=lookup_drafts is not False, confidence_threshold=confidence_threshold)
    result = speculative_loop(target, prompt_ids, params, source, max_new_tokens=max_new_tokens, cap=cap,
                              stream=TextStream(tokenizer, stop, on_text), mode=drafter.kind, on_round=on_round)
    result.host_reads += source.extra_reads
    return result


def check_pipeline(target: Target, drafter, *, confidence_threshold: float = 0.0) -> None:
    """Refuse a pipelined run it cannot do exactly, saying what to change."""
    if drafter.kind != "dspark":
        raise InputError(f"pipeline works with DSpark heads; this is a {drafter.kind} head. Run it without pipeline.")
    if confidence_threshold > 0:
        raise InputError("pipeline cannot truncate drafts by confidence (that needs a host read inside the round): "
                         "set confidence_threshold to 0, or run without pipeline.")
    check_pipeline_target(target)


def check_pipeline_target(target: Target) -> None:
    """Refuse a target the pipelined loop cannot run exactly: caches other than plain KV
    (InputError), or an offset-addressed forward that does not reproduce it (LoadError)."""
    if not target.can_pipeline(target.make_cache()):
        raise InputError(f"pipeline needs plain KV caches; model_type {target.model_type!r} keeps recurrent, rotating or "
                         "quantized cache state that cannot be rewound by moving an offset. Run it without pipeline.")
    target.check_offset_forward()  # once per model


@dataclass
class PairConfig:
    """How a pair was resolved, and on what measurement an automatic choice rests."""

    model: str
    drafter: str | None
    mode: str
    max_draft_tokens: int
    source: str  # "user" | "registry"
    evidence: dict = field(default_factory=dict)


def _registry_data(path: str | os.PathLike | None) -> dict:
    if path is not None:
        return json.loads(open(path).read())
    return json.loads(resources.files("dspark_lab").joinpath("data/registry.json").read_text())


def read_registry(path: str | os.PathLike | None = None) -> list[dict]:
    """The registry of measured pairs shipped with the package (or a file given)."""
    return _registry_data(path).get("pairs", [])


def load_pair(
    model: str | os.PathLike,
    drafter: str | os.PathLike | None = None,
    *,
    drafter_bits: int = 4,
    drafter_window: int = 4096,
    max_draft_tokens: int | None = None,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    dtype: str | None = None,
    registry: str | os.PathLike | None = None,
    machine: str | None = None,
):
    """Load a target and its drafter head -> (target, tokenizer, drafter, PairConfig).

    With no drafter, the registry of measured pairs picks one: the entry for this model (any
    quantization; the entry of the precision a local folder is stored at, MODEL@q8 say, where the
    registry has one) measured on `machine` if given, else on the same backend, else anywhere; the
    PairConfig's `evidence` says which measurement the choice rests on. A model with no entry
    is an error that says to pass `drafter=` or use lookup. A `mode` of "dspark-pipe" means the
    head was measured fastest through the pipelined loop: pass `pipeline=True` to
    speculative_generate, with the loop options it was measured with (`evidence["options"]`:
    lookup_drafts, compile_draft)."""
    source, evidence, mode = "user", {}, "dspark"
    if drafter is None:
        entry = _registry_entry(str(model), registry, machine)
        if entry is None:
            raise LoadError(
                f"no measured drafter for {str(model)!r} in the registry. Pass drafter= (--drafter DIR) "
                "with a DSpark head for this model, or use lookup decoding (--mode lookup), which needs none."
            )
        if not entry.get("drafter"):
            raise LoadError(
                f"the registry's best measured mode for {str(model)!r} is {entry.get('mode')!r}, which needs no drafter "
                f"({entry.get('speedup')}x on {entry.get('machine') or entry.get('device')}): use --mode lookup, or pass drafter=."
            )
        if entry.get("mode") in ("draft", "draft-pipe"):
            # A draft model is not a head: it loads through load_draft_pair, not the head loaders.
            raise LoadError(
                f"the registry's best measured mode for {str(model)!r} is {entry['mode']} with the draft model {entry['drafter']!r}: "
                f"use --mode {entry['mode']} --draft-model {entry['drafter']} (load_draft_pair), or pass drafter= with a head."
            )
        drafter, source, mode = _registry_drafter(entry["drafter"], str(model)), "registry", entry.get("mode", "dspark")
        cap = entry.get("cap")
        if max_draft_tokens is None and isinstance(cap, int):
            max_draft_tokens = cap
        evidence = {k: entry.get(k) for k in ("speedup", "ci", "mean_accept_len", "trials", "machine", "device", "run_ids", "date", "cap",
                                              "drafter_digest")}
        evidence["options"] = dict(entry.get("options") or {})
        if str(entry.get("target", "")).endswith(f"@{ROWS_KERNEL}"):
            # Measured with the target's products routed through the rows kernel: to run at that
            # speed the caller routes it (the CLI does; Target.route_quantized_rows).
            evidence["options"]["rows_kernel"] = True
        _check_measured_version(entry, drafter, str(model))
    return _load_head_pair(model, drafter, mode, drafter_bits=drafter_bits, drafter_window=drafter_window,
                           max_draft_tokens=max_draft_tokens, trust_remote_code=trust_remote_code, kv_bits=kv_bits, dtype=dtype,
                           source=source, evidence=evidence)


def _load_head_pair(model, drafter, mode: str, *, drafter_bits, drafter_window, max_draft_tokens, trust_remote_code, kv_bits,
                    dtype, source="user", evidence=None):
    from .drafters.load import load_dflash, load_dspark

    target, tokenizer = load_target(model, trust_remote_code=trust_remote_code, kv_bits=kv_bits, dtype=dtype)
    loader = load_dflash if mode == "dflash" else load_dspark
    head = loader(drafter, target, bits=drafter_bits, window=drafter_window)
    # DSpark defaults to a short draft; DFlash to its full block (what it was trained to fill).
    cap = max_draft_tokens or (head.config.max_drafts if mode == "dflash" else min(2, head.config.max_drafts))
    return target, tokenizer, head, PairConfig(str(model), str(drafter), mode, cap, source, evidence or {})


def changed_drafter(entry: dict, drafter: str | None = None) -> str | None:
    """The weights digest of a registry entry's drafter as this machine has it (or of `drafter`),
    where it differs from the one the entry measured; None when they agree, or when either is
    unknown (an entry from before digests, a drafter that is no local folder or is not here)."""
    measured = entry.get("drafter_digest")
    if not measured or not entry.get("drafter"):
        return None
    if drafter is None:
        try:
            drafter = _registry_drafter(entry["drafter"], str(entry.get("target", "")))
        except LoadError:
            return None
    local = weights_digest(drafter)
    return local if local and local != measured else None


def _check_measured_version(entry: dict, drafter: str, model: str) -> None:
    """Warn when the registry measured other weights of this drafter than the folder holds now (a
    head continued by a training session and stored again at the same path): the pair still runs
    losslessly, but the measured speedup is another head's."""
    measured, local = entry.get("drafter_digest"), changed_drafter(entry, drafter)
    if local:
        warnings.warn(MeasuredVersionWarning(
            f"the registry measured {entry.get('speedup')}x for {model!r} with other weights of the drafter {entry['drafter']!r} "
            f"(weights digest {measured}; this folder's: {local}): the head was changed since, and its speed may differ. "
            "Measure this version with `dspark-lab sweep` and rebuild the registry (`dspark-lab registry build`)."), stacklevel=3)


def _backend() -> str:
    if mx.default_device().type != mx.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def _registry_drafter(drafter: str, model: str) -> str:
    """A registry entry's drafter as this machine has it. The shipped registry names the heads
    committed in the dspark-lab repository by their place there (fixtures/NAME): found from the
    current directory, in the checkout this package runs from (pip install -e .), or in the
    package itself, where a wheel's build put the heads the registry names (setup.py:
    dspark_lab/heads/NAME). Anything else (a path, a hub repo id) is returned as written, for the
    loaders to find or explain."""
    if Path(drafter).expanduser().exists():
        return drafter
    package = Path(__file__).resolve().parents[1]
    in_checkout = package.parent / drafter
    if not Path(drafter).is_absolute() and in_checkout.exists():
        return str(in_checkout)
    if drafter.replace("\\", "/").startswith("fixtures/"):
        shipped = package / "heads" / Path(drafter).name
        if shipped.is_dir():
            return str(shipped)
        raise LoadError(
            f"the registry's drafter for {model!r} is {drafter!r}, a head committed in the dspark-lab repository, and "
            "this installation has neither a checkout beside it nor the head inside the package. Reinstall dspark-lab "
            "(a wheel carries the registry's heads), run from a clone of the repository (pip install -e .), or pass "
            "drafter= (--drafter DIR) with a copy of that folder."
        )
    return drafter


def _stored_precision(model: str) -> str | None:
    """The precision label (names.split_variant's: qN, or dequantized for float weights) a local
    model folder loads at, from its config.json; None where that is unknown (a hub id)."""
    from .names import DEQUANTIZED

    try:
        config = read_model_config(Path(model).expanduser())
    except (LoadError, OSError):
        return None
    quant = quantization_entry(config)
    if quant is None:
        return DEQUANTIZED
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return f"q{bits}" if isinstance(bits, int) else None


def _registry_entry(model: str, registry, machine: str | None) -> dict | None:
    """The registry entry for this model (quant-agnostic), best matching this machine. Where the
    registry also measured the precision this model is stored at (a sweep's MODEL@q8 entry, say),
    that entry: its speedup was measured against greedy decoding at that precision. On CUDA a
    MODEL@rows-kernel entry (the stored weights, products through the rows kernel) competes too.
    Where no entry was measured on `machine` but the registry refused this model there as slower
    than plain decoding (`slower_than_plain`), PlainIsFaster: another machine's entry would not hold."""
    from .names import DEQUANTIZED, target_key

    key, label = target_key(model), _stored_precision(model)
    keyed = [(target_key(str(e.get("target", ""))), e) for e in read_registry(registry)]
    entries = [e for k, e in keyed if k == key]
    labelled = [e for k, e in keyed if label is not None and k == f"{key}@{label}"]
    if labelled:
        entries = labelled
    elif _backend() == "cuda" and label != DEQUANTIZED:
        # Beside the model's own entry, the same stored weights with their products through the
        # rows kernel (CUDA only; a sweep's MODEL@rows-kernel): the faster measured one wins.
        entries += [e for k, e in keyed if k == f"{key}@{ROWS_KERNEL}"]
    # Read only where no entry was measured on this machine: the refusals can change nothing else.
    here = machine is not None and any(e.get("machine") == machine for e in entries)
    slower = None if machine is None or here else next(
        (r for r in _registry_data(registry).get("refused", [])
         if r.get("slower_than_plain") and r.get("machine") == machine and r.get("target") == key), None)
    if slower is not None:
        raise PlainIsFaster(
            f"on {machine} the registry measured {model!r} decoding faster plainly than with any drafter "
            f"({slower.get('mode')} with {slower.get('drafter')} at cap {slower.get('cap')}: x{slower.get('speedup')} over "
            f"{slower.get('trials')} trials); use --mode baseline, or pass drafter= to speculate anyway."
        )
    if not entries:
        return None

    def rank(e):
        return (machine is not None and e.get("machine") == machine, e.get("backend") == _backend(), e.get("speedup") or 0.0)

    return max(entries, key=rank)


def dflash_generate(target: Target, tokenizer, drafter, prompt, *, max_draft_tokens: int | None = None, lookup_drafts: bool = False, **kwargs) -> GenResult:
    """Speculative decoding with a DFlash / DFlash 2 head; `max_draft_tokens=None` drafts the
    full block (block_size - 1 tokens)."""
    return speculative_generate(target, tokenizer, drafter, prompt, max_draft_tokens=max_draft_tokens or drafter.config.max_drafts,
                                lookup_drafts=lookup_drafts, **kwargs)


def load_dflash_pair(
    model: str | os.PathLike,
    drafter: str | os.PathLike,
    *,
    drafter_bits: int = 4,
    drafter_window: int = 4096,
    max_draft_tokens: int | None = None,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    dtype: str | None = None,
):
    """Load a target and its DFlash / DFlash 2 head -> (target, tokenizer, drafter, PairConfig)."""
    return _load_head_pair(model, drafter, "dflash", drafter_bits=drafter_bits, drafter_window=drafter_window,
                           max_draft_tokens=max_draft_tokens, trust_remote_code=trust_remote_code, kv_bits=kv_bits, dtype=dtype)


# --- a small language model as the drafter ---------------------------------------------------------

DEFAULT_DRAFT_MODEL_CAP = 4

# Strings both tokenizers must encode to the same ids: prose, code, digits, whitespace runs,
# accents, CJK and an emoji (byte fallback), and the chat markers most templates use.
TOKENIZER_PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # double\n",
    " 12345 + 67890 = 80235",
    "na\u00efve caf\u00e9, \u00fcber, se\u00f1or",
    "\u6771\u4eac\u3068\u5317\u4eac \U0001f642",
    "<|im_start|>user\nhi<|im_end|>\n",
)


def _tokenizer_len(tokenizer) -> int:
    """Token ids the tokenizer can produce, added tokens included (mlx-lm wraps the HF one)."""
    return len(getattr(tokenizer, "_tokenizer", tokenizer))


def check_same_tokenizer(tokenizer, draft_tokenizer, drafter: Target, *, model: str = "target", draft_model: str = "draft model") -> None:
    """Refuse a drafter whose tokenizer is not the target's: its drafts would be ids of other
    text. Embedding shapes are not compared (same-tokenizer models often pad their embedding
    matrices differently); the tokenizers are: their size, and the ids of probe strings."""
    fix = "Pick a draft model from the target's family that shares its tokenizer (e.g. Qwen2.5-0.5B-Instruct for Qwen2.5-7B-Instruct)."
    n, m = _tokenizer_len(tokenizer), _tokenizer_len(draft_tokenizer)
    if n != m:
        raise LoadError(f"draft model {draft_model!r} has a tokenizer of {m} tokens but {model!r} has {n}: "
                        f"the drafter must use the target's tokenizer. {fix}")
    for probe in TOKENIZER_PROBES:
        a, b = list(tokenizer.encode(probe)), list(draft_tokenizer.encode(probe))
        if a != b:
            raise LoadError(f"draft model {draft_model!r} tokenizes {probe!r} differently from {model!r} ({b[:8]} vs {a[:8]}): "
                            f"the drafter must use the target's tokenizer. {fix}")
    if drafter.vocab_size < n:
        raise LoadError(f"draft model {draft_model!r} embeds only {drafter.vocab_size} token ids but the tokenizer has {n}; "
                        f"its weights do not cover the tokenizer. {fix}")


def load_draft_pair(
    model: str | os.PathLike,
    draft_model: str | os.PathLike,
    *,
    max_draft_tokens: int | None = None,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    dtype: str | None = None,
):
    """Load a target and a small draft model with the same tokenizer -> (target, tokenizer,
    drafter, PairConfig); the drafter is a `Target` too. `kv_bits` quantizes the target's
    cache only (the drafter's is small); `dtype` casts both."""
    target, tokenizer = load_target(model, trust_remote_code=trust_remote_code, kv_bits=kv_bits, dtype=dtype)
    drafter, draft_tokenizer = load_target(draft_model, trust_remote_code=trust_remote_code, dtype=dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer, drafter, model=str(model), draft_model=str(draft_model))
    cap = max_draft_tokens or DEFAULT_DRAFT_MODEL_CAP
    return target, tokenizer, drafter, PairConfig(str(model), str(draft_model), "draft", cap, "user")


def draft_model_generate(
    target: Target,
    tokenizer,
    drafter: Target,
    prompt: str | Sequence[int] | list[dict],
    *,
    max_new_tokens: int = 256,
    max_draft_tokens: int = DEFAULT_DRAFT_MODEL_CAP,
    cap_controller=None,
    pipeline: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    on_text: Callable[[str], None] | None = None,
    apply_chat_template: bool = True,
) -> GenResult:
    """Speculative decoding with a small draft model (same tokenizer as the target): each round
    it drafts up to `max_draft_tokens` (or what `cap_controller` chooses, at most that) one by
    one, and the target verifies them in one forward. Output is the target's own greedy
    tokens, or an exact sample of the target at temperature > 0. `pipeline`: build each round
    while the previous one computes (engine/pipeline.py, mode "draft-pipe"); target and draft
    model both need plain KV caches."""
    from .drafters.draft_model import DraftModelSource, PipelinedDraftModel

    params, prompt_ids = _setup(target, tokenizer, prompt, max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template)
    if not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
        raise InputError(f"max_draft_tokens must be >= 1 for a draft model, got {max_draft_tokens!r}.")
    cap, on_round = cap_schedule(cap_controller, max_draft_tokens, max_draft_tokens)
    stream = TextStream(tokenizer, stop, on_text)
    if pipeline:
        for model in (target, drafter):
            check_pipeline_target(model)
        from .pipeline import pipelined_loop

        source = PipelinedDraftModel(drafter, target.vocab_size, prompt_ids, max_draft_tokens)
        return pipelined_loop(target, prompt_ids, params, source, max_new_tokens=max_new_tokens, cap=cap, stream=stream,
                              mode="draft-pipe", on_round=on_round)
    return speculative_loop(target, prompt_ids, params, DraftModelSource(drafter, target.vocab_size), max_new_tokens=max_new_tokens,
                            cap=cap, stream=stream, mode="draft", on_round=on_round)
