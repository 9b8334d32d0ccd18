"""z-lab's DFlash and DFlash 2 block-diffusion draft heads in MLX.

A DFlash head is a small Qwen3-style stack conditioned on the target: the target's tapped
residual rows are fused (`hidden_norm(fc(concat))`) and every layer projects them into its own
context K/V, exactly like a DSpark head. The block `[anchor] + [mask] * (block_size - 1)` is
denoised in one parallel pass; the mask slots 1..block_size-1 are the drafts, scored by the
TARGET's lm_head (the head has no embeddings or lm_head of its own), times `output_multiplier`,
softcapped when configured. Full-attention layers see the block bidirectionally, sliding layers
causally within their window, unless `is_causal` says otherwise.

DFlash 2 adds, per layer, a dynamic two-sided convolution along the block rows around the
attention and the MLP, and a candidate-path selector: for each slot the top-K tokens of the
lm_head are re-scored with a low-rank bilinear term between the previous slot's chosen token
and each candidate, and the draft is the best path (greedy) or a sampled one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ...errors import LoadError
from .dspark import MLP, BlockOut, ContextDrafter, DraftAttention
from .dspark_config import DSparkConfig


@dataclass
class DFlashConfig:
    backbone: DSparkConfig  # the Qwen3 stack's shapes (reuses DSpark's attention and MLP)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    version: int = 1
    layer_types: list[str] = field(default_factory=list)  # full_attention | sliding_attention
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal, full layers bidirectional
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    conv_kernel_size: int = 0  # DFlash 2
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 0
    ignored: list[str] = field(default_factory=list)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    @property
    def logits_start(self) -> int:
        return 1


def parse_dflash_config(cfg: dict, tensor_names: set[str]) -> DFlashConfig:
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    get = lambda k, default=None: nested.get(k, cfg.get(k, default))  # noqa: E731
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any("DSpark" in a for a in archs) or nested.get("projector_type") == "dspark" or "speculators_config" in cfg:
        raise LoadError(f"this is a DSpark head ({', '.join(archs) or 'dspark projector'}), not a DFlash head; run it with --mode dspark (load_pair).")
    if get("markov_rank") or any(n.startswith(("markov_head.", "logit_head.markov_head.")) for n in tensor_names):
        raise LoadError("this DFlash head carries a Markov head (a DFlash+DSpark hybrid), which dspark-lab does not support.")
    if get("block_size") is None:
        raise LoadError("config has no block_size (at the top level or under dflash_config): this does not look like a DFlash checkpoint.")
    missing = [k for k in ("mask_token_id", "target_layer_ids") if get(k) is None]
    missing += [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise LoadError(f"DFlash config is missing required fields: {', '.join(missing)}.")
    has_v2_tensors = any(".attention_conv." in n or n.startswith("candidate_selector.") for n in tensor_names)
    is_v2 = any("DFlash2" in a for a in archs) or bool(get("selector_rank")) or bool(get("conv_kernel_size")) or has_v2_tensors
    if is_v2:
        absent = [k for k in ("selector_rank", "selector_top_k", "conv_kernel_size") if not get(k)]
        if absent:
            raise LoadError(
                f"this is a DFlash 2 checkpoint but its config lacks {', '.join(absent)}; dspark-lab will not run a DFlash 2 head "
                "as DFlash 1 (its convolutions and selector would be skipped). Repair the config."
            )
    if cfg.get("model_type", "qwen3") not in ("qwen3", "qwen2", "llama"):
        raise LoadError(f"unsupported DFlash backbone family {cfg.get('model_type')!r}; dspark-lab supports qwen3-style heads.")
    n_layers = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n_layers)
    if len(layer_types) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise LoadError(f"layer_types must list full_attention / sliding_attention for each of the {n_layers} layers, got {layer_types}.")
    window = get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise LoadError("layer_types has sliding_attention layers but the config gives no sliding_window.")
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 1e6
    backbone = DSparkConfig(
        hidden_size=int(cfg["hidden_size"]), vocab_size=int(cfg["vocab_size"]), num_hidden_layers=n_layers,
        intermediate_size=int(cfg["intermediate_size"]), num_attention_heads=int(cfg["num_attention_heads"]),
        block_size=int(get("block_size")), mask_token_id=int(get("mask_token_id")), target_layer_ids=[int(t) for t in get("target_layer_ids")],
        num_key_value_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), attention_bias=bool(cfg.get("attention_bias", False)), markov_rank=0,
        has_embed_tokens=False, has_lm_head=False,
    )
    return DFlashConfig(
        backbone=backbone, block_size=backbone.block_size, mask_token_id=backbone.mask_token_id,
        target_layer_ids=backbone.target_layer_ids, version=2 if is_v2 else 1, layer_types=layer_types,
        sliding_window=int(window) if window else None, is_causal=cfg.get("is_causal"),
        output_multiplier=float(get("output_multiplier", 1.0)), final_logit_softcapping=get("final_logit_softcapping"),
        input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        conv_kernel_size=int(get("conv_kernel_size", 0) or 0), conv_group_size=int(get("conv_group_size", 16) or 16),
        selector_rank=int(get("selector_rank", 0) or 0), selector_top_k=int(get("selector_top_k", 0) or 0),
        ignored=[k for k in ("auto_map",) if k in cfg],
    )


class GroupedConv(nn.Module):
    """DFlash 2's dynamic convolution over block rows: out[t] = sum_tap coeff[t, tap] * x[t - tap]
    (zero before the anchor). One projection of the sublayer's input gives the coefficient
    corrections of both sides: side 0 convolves the input, side 1 the sublayer's output."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        if hidden % group:
            raise LoadError(f"conv_group_size {group} must divide hidden_size {hidden}.")
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def _convolve(self, x: mx.array, delta: mx.array, side: int) -> mx.array:
        # delta: (B, L, taps, groups) -> per-channel coefficients (B, L, taps, H)
        coeff = self.base_kernel[side][None, None] + mx.repeat(delta, self.group, axis=-1)
        out = coeff[:, :, 0] * x
        for tap in range(1, self.taps):
            shifted = mx.pad(x[:, :-tap], [(0, 0), (tap, 0), (0, 0)])
            out = out + coeff[:, :, tap] * shifted
        return out

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        d = self.kernel_projection(x).reshape(B, L, 2, self.taps, self.groups)
        return self._convolve(x, d[:, :, 0], 0), d[:, :, 1]

    def finish(self, y: mx.array, delta: mx.array) -> mx.array:
        return self._convolve(y, delta, 1)


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        b = c.backbone
        self.self_attn = DraftAttention(b)
        self.mlp = MLP(b)
        self.input_layernorm = nn.RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        if c.conv_kernel_size:
            self.attention_conv = GroupedConv(b.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedConv(b.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def __call__(self, x, cache, offset, mask):
        a = self.input_layernorm(x)
        conv = "attention_conv" in self
        if conv:
            a, post = self.attention_conv.prepare(a)
        attn = self.self_attn(a, cache, offset, mask)
        h = x + (self.attention_conv.finish(attn, post) if conv else attn)
        m = self.post_attention_layernorm(h)
        if conv:
            m, post = self.mlp_conv.prepare(m)
        out = self.mlp(m)
        return h + (self.mlp_conv.finish(out, post) if conv else out)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))


class DFlashHead(nn.Module):
    def __init__(self, c: DFlashConfig, target_hidden: int):
        super().__init__()
        b = c.backbone
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * target_hidden, b.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.layers = [DFlashLayer(c) for _ in range(b.num_hidden_layers)]
        self.norm = nn.RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        if c.selector_rank:
            self.candidate_selector = CandidateSelector(b.hidden_size, b.vocab_size, c.selector_rank)


class DFlashDrafter(ContextDrafter):
    """A loaded DFlash / DFlash 2 head bound to its target (embeddings and lm_head)."""

    kind = "dflash"

    def _mask(self, layer_type: str, width: int) -> mx.array:
        """Keys each block row sees, over the bucketed keys: context within the drafter window;
        full layers bidirectional, sliding layers causal within their window (z-lab's
        defaults), unless the config's is_causal says otherwise."""
        c = self.config
        q, k, visible = self._positions(width)
        sliding = layer_type == "sliding_attention"
        causal = c.is_causal if c.is_causal is not None else sliding
        if causal:
            visible = visible & (k <= q)
        if sliding:
            visible = visible & (q - k < c.sliding_window)
            if not causal:
                visible = visible & (k - q < c.sliding_window)
        return visible

    def _logits(self, h: mx.array) -> mx.array:
        c = self.config
        logits = self.lm_head(h).astype(mx.float32) * c.output_multiplier
        if c.final_logit_softcapping:
            logits = mx.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def draft(self, pending: int, cap: int, params) -> BlockOut:
        from ..sampling import target_probs

        c = self.config
        cap = min(cap, c.max_drafts)
        width = c.block_size
        ids = mx.concatenate([mx.array([pending], dtype=mx.uint32).reshape(1), mx.full((width - 1,), c.mask_token_id, dtype=mx.uint32)])
        h = self.embed(ids[None])
        if c.input_embedding_scale != 1.0:
            h = h * c.input_embedding_scale
        for layer, cache, kind in zip(self.head.layers, self.caches, c.layer_types):
            h = layer(h, cache, self.ctx_len, self._mask(kind, width))
        for cache in self.caches:
            cache.trim(width)
        hidden = self.head.norm(h)[0, 1 : 1 + cap]
        logits = self._logits(hidden)[:, : c.backbone.vocab_size]
        if c.selector_rank:
            return self._select(logits, hidden, pending, params)
        if params.greedy:
            return BlockOut(mx.argmax(logits, axis=-1).astype(mx.uint32), None, None)
        q = target_probs(logits, params)
        return BlockOut(mx.random.categorical(mx.log(q), axis=-1).astype(mx.uint32), q, None)

    def _select(self, logits, hidden, pending, params) -> BlockOut:
        """DFlash 2's path through the top-K candidates of every slot."""
        sel = self.head.candidate_selector
        K = self.config.selector_top_k
        cand = mx.argpartition(-logits, K - 1, axis=-1)[:, :K]  # (cap, K)
        unary = mx.take_along_axis(logits, cand, axis=-1)
        proj = sel.hidden_projection(hidden).astype(mx.float32)  # (cap, rank)
        succ = sel.successor_codebook[cand].astype(mx.float32)  # (cap, K, rank)
        pred = mx.array([pending], dtype=mx.uint32)
        tokens, probs = [], []
        for s in range(cand.shape[0]):
            scores = unary[s] + (succ[s] @ (sel.predecessor_codebook[pred][0].astype(mx.float32) * proj[s]))
            if params.greedy:
                k = mx.argmax(scores)
            else:
                q = mx.softmax(scores / params.temperature)
                k = mx.random.categorical(mx.log(q))
                dense = mx.zeros((self.config.backbone.vocab_size,), mx.float32)
                probs.append(mx.put_along_axis(dense, cand[s].astype(mx.int32), q, axis=-1)[None])
            pred = cand[s][k].reshape(1).astype(mx.uint32)
            tokens.append(pred)
        toks = mx.concatenate(tokens) if tokens else mx.zeros((0,), mx.uint32)
        return BlockOut(toks, mx.concatenate(probs) if probs else None, None)
