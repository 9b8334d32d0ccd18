"""Recognize a DSpark head's packaging and normalize its config.

DSpark heads are published in several layouts. Each is recognized from config.json (and the
tensor names), normalized into one `DSparkConfig`, and its tensor names mapped onto the
DeepSpec-native names the MLX module uses. Anything that is not a DSpark head we can run is
refused with the reason: a speculators checkpoint of another algorithm, a full model with an
embedded drafter, a DFlash head, an unsupported backbone, missing fields, an incomplete
reduced vocabulary.

Layouts:
- native (DeepSpec): fields at the top level; architectures `Qwen3DSparkModel` /
  `Gemma4DSparkModel`.
- speculators (vLLM): `speculators_config.algorithm == "dspark"`, backbone in
  `transformer_layer_config`, taps in `aux_hidden_state_layer_ids`, draft count in
  `proposal_methods[0].speculative_tokens`, optional reduced vocab with d2t/t2d tensors.
- specforge (SpecForge / SGLang): `dflash_config.projector_type == "dspark"`, DSpark fields
  nested in `dflash_config`, no own embeddings or lm_head.
- dflash-causal: DFlash-lineage DSpark heads with a causal block, an optional sliding window
  and attention-sink bias, no own lm_head.
- lfm2: `Lfm2DSparkDraftModel`, taps nested in `dflash_config`, interleaved rope.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import LoadError

REQUIRED = ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "block_size", "mask_token_id", "target_layer_ids")
BACKBONES = {"qwen3": "qwen3", "qwen2": "qwen3", "llama": "qwen3", "lfm2": "qwen3",
             "gemma4": "gemma4", "gemma4_text": "gemma4"}
MARKOV_TYPES = ("vanilla",)


@dataclass
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    backbone: str = "qwen3"  # qwen3 | gemma4
    packaging: str = "native"
    num_key_value_heads: int | None = None  # default: num_attention_heads
    head_dim: int | None = None  # default: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    partial_rotary_factor: float = 1.0  # gemma4: rotate only this share of head_dim
    rope_interleaved: bool = False  # lfm2: GPT-J style pairs instead of rotate-half
    attention_bias: bool = False
    attention_k_eq_v: bool = False  # gemma4: V comes from k_proj (no v_proj)
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None  # reduced output vocab (speculators), with d2t offsets
    logits_start: int = 0  # first block slot whose logits are a draft (0: the anchor slot)
    causal: bool = False  # causal block (DFlash lineage) instead of bidirectional
    sliding_window: int | None = None  # only for the causal lineage, which trained with one
    attention_sink: bool = False
    has_embed_tokens: bool = True
    has_lm_head: bool = True
    ignored: list[str] = field(default_factory=list)  # fields present but not obeyed (auto_map, ...)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def max_drafts(self) -> int:
        return self.block_size - self.logits_start


def _rope_theta(cfg: dict, default: float) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        full = params.get("full_attention")
        if isinstance(full, dict) and "rope_theta" in full:
            return float(full["rope_theta"])
    return float(cfg.get("rope_theta", default))


def detect_packaging(cfg: dict, tensor_names: set[str]) -> str:
    """Which layout this is, or a LoadError saying what it is instead."""
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else None
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else None
    if spec is not None or "speculators_model_type" in cfg:
        algo = (spec or {}).get("algorithm") or cfg.get("speculators_model_type")
        if algo != "dspark":
            raise LoadError(f"this is a vLLM speculators checkpoint of algorithm {algo!r}, not 'dspark'; dspark-lab's DSpark loader runs only DSpark heads.")
        return "speculators"
    if any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs) or any(n.startswith("model.layers.") for n in tensor_names):
        raise LoadError(
            f"this looks like a full model ({', '.join(archs) or 'model.layers.* tensors'}), possibly with an embedded drafter, "
            "not a standalone DSpark head. Pass the target with --model and the head's own directory with --drafter."
        )
    if dflash is not None and dflash.get("projector_type") == "dspark":
        return "specforge"
    if any("Lfm2DSpark" in a for a in archs):
        return "lfm2"
    if is_dflash_head(cfg, tensor_names):
        hybrid = "DFlash 2" if "selector_rank" in cfg or "selector_rank" in (dflash or {}) else "DFlash"
        raise LoadError(
            f"this is a {hybrid} block-diffusion head ({', '.join(archs) or 'dflash_config'}), not a DSpark head: "
            "it has no Markov head and no DSpark marker. Run it with --mode dflash (load_dflash_pair)."
        )
    if _dflash_marked(cfg):
        return "dflash-causal"  # DFlash-lineage, but with a Markov head: a DSpark head
    return "native"


def _dflash_marked(cfg: dict[str, Any]) -> bool:
    """Marked as a DFlash-lineage checkpoint and not as a DSpark one."""
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    dflash_like = any("DFlash" in a for a in archs) or isinstance(cfg.get("dflash_config"), dict) or "dflash_query_causal" in cfg
    return dflash_like and not any("DSpark" in a for a in archs)


def is_dflash_head(cfg: dict[str, Any], tensor_names: set[str]) -> bool:
    """A plain DFlash / DFlash 2 head, which load_dflash runs: DFlash-marked, with no Markov head
    and no DSpark packaging (SpecForge's projector, speculators), which would make it a DSpark head."""
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    if nested.get("projector_type") == "dspark" or "speculators_config" in cfg or "speculators_model_type" in cfg:
        return False
    has_markov = any(n.startswith(("markov_head.", "logit_head.markov_head.")) for n in tensor_names)
    return _dflash_marked(cfg) and not has_markov and not cfg.get("markov_rank")


def parse_dspark_config(cfg: dict[str, Any], tensor_names: set[str]) -> DSparkConfig:
    packaging = detect_packaging(cfg, tensor_names)
    ignored = [k for k in ("auto_map", "model_file") if k in cfg]  # drafters never import code
    flat = dict(cfg)
    if packaging == "speculators":
        inner = cfg.get("transformer_layer_config") or {}
        flat = {**inner, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
        flat.setdefault("target_layer_ids", cfg.get("aux_hidden_state_layer_ids"))
        flat["model_type"] = inner.get("model_type", "qwen3")
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        n_spec = methods[0].get("speculative_tokens")
        if "logits_start" not in cfg:
            if n_spec is not None and "block_size" in flat:
                flat["logits_start"] = int(flat["block_size"]) - int(n_spec)
            elif "sample_from_anchor" in cfg:
                flat["logits_start"] = 0 if cfg["sample_from_anchor"] else 1
    elif packaging in ("specforge", "lfm2", "dflash-causal"):
        nested = cfg.get("dflash_config") or {}
        flat = {**cfg, **{k: v for k, v in nested.items() if k != "projector_type"}}
    if flat.get("target_layer_ids") is None and "aux_hidden_state_layer_ids" in flat:
        flat["target_layer_ids"] = flat["aux_hidden_state_layer_ids"]

    missing = [k for k in REQUIRED if flat.get(k) is None]
    if missing:
        raise LoadError(f"DSpark config ({packaging} layout) is missing required fields: {', '.join(missing)}.")
    model_type = str(flat.get("model_type", "qwen3"))
    if packaging == "lfm2":
        model_type = "lfm2"
    if model_type not in BACKBONES:
        raise LoadError(f"unsupported DSpark backbone family {model_type!r}; dspark-lab supports {', '.join(sorted(set(BACKBONES)))}.")
    backbone = BACKBONES[model_type]

    draft_vocab = flat.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) == int(flat["vocab_size"]):
        draft_vocab = None  # a "reduced" vocab as large as the full one needs no table
    has_d2t = "d2t" in tensor_names
    if draft_vocab is not None and not has_d2t:
        raise LoadError(f"config declares draft_vocab_size={draft_vocab} but the checkpoint has no d2t table to map draft ids to target ids.")
    if has_d2t and draft_vocab is None:
        raise LoadError("the checkpoint has a d2t table but the config declares no draft_vocab_size smaller than vocab_size; the head is inconsistent.")
    markov_type = flat.get("markov_head_type", "vanilla")
    if int(flat.get("markov_rank", 256) or 0) > 0 and markov_type not in MARKOV_TYPES:
        raise LoadError(f"Markov head type {markov_type!r} is not supported (only {', '.join(MARKOV_TYPES)}).")

    causal = bool(flat.get("dflash_query_causal") or flat.get("causal") or packaging == "dflash-causal")
    window = None
    if causal:
        # Only the causal lineage trained with a window; native heads inherit the target's
        # `sliding_window` / `layer_types` by deep copy and never use them, so those are ignored.
        window = flat.get("swa_window_size") if flat.get("use_swa") else flat.get("sliding_window")
    elif "sliding_window" in flat:
        ignored.append("sliding_window")
    gemma = backbone == "gemma4"
    head_dim = flat.get("global_head_dim") if gemma and flat.get("global_head_dim") else flat.get("head_dim")
    kv = flat.get("num_global_key_value_heads") if gemma and flat.get("attention_k_eq_v") else flat.get("num_key_value_heads")
    rope_params = flat.get("rope_parameters") or {}
    partial = (rope_params.get("full_attention") or {}).get("partial_rotary_factor") if isinstance(rope_params, dict) else None
    return DSparkConfig(
        hidden_size=int(flat["hidden_size"]), vocab_size=int(flat["vocab_size"]),
        num_hidden_layers=int(flat["num_hidden_layers"]), intermediate_size=int(flat["intermediate_size"]),
        num_attention_heads=int(flat["num_attention_heads"]), block_size=int(flat["block_size"]),
        mask_token_id=int(flat["mask_token_id"]), target_layer_ids=[int(t) for t in flat["target_layer_ids"]],
        backbone=backbone, packaging=packaging,
        num_key_value_heads=int(kv) if kv else None, head_dim=int(head_dim) if head_dim else None,
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(flat, 1e6),
        partial_rotary_factor=float(partial or flat.get("partial_rotary_factor", 1.0)),
        rope_interleaved=packaging == "lfm2" and not flat.get("rope_is_neox_style", False),
        attention_bias=bool(flat.get("attention_bias", False)),
        attention_k_eq_v=bool(gemma and flat.get("attention_k_eq_v", False)),
        markov_rank=int(flat.get("markov_rank", 256) or 0), markov_head_type=markov_type,
        enable_confidence_head=bool(flat.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(flat.get("confidence_head_with_markov", True)),
        final_logit_softcapping=flat.get("final_logit_softcapping") or None,
        draft_vocab_size=int(draft_vocab) if draft_vocab else None,
        logits_start=int(flat.get("logits_start", 0 if flat.get("sample_from_anchor", True) else 1)),
        causal=causal, sliding_window=int(window) if window else None,
        attention_sink=bool(flat.get("attention_sink_bias", False)) or any("attention_sink_bias" in n for n in tensor_names),
        has_embed_tokens="embed_tokens.weight" in tensor_names,
        has_lm_head="lm_head.weight" in tensor_names,
        ignored=ignored,
    )


def rename_tensor(name: str) -> str:
    """Map a packaging's tensor name onto the native one (SpecForge's legacy prefixes)."""
    for old, new in (("logit_head.markov_head.", "markov_head."), ("logit_head.confidence_head.", "confidence_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name
