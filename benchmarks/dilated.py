#!/usr/bin/env python3
"""Dilated attention (LongNet): this library's fused path beside the composites a user writes today.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/dilated.py --out benchmarks/results [--quick]

Cases (bf16, B=1, 16 heads of 128, not causal, forward and forward+backward):
    dilated    segments (2048, 4096, 8192), rates (1, 2, 4) at 8k, 32k and 128k tokens
    dilated4   segments (2048, 4096, 8192, 16384), rates (1, 2, 4, 8) at 32k, merge="lse"
    groups4    the same with merge="head_groups" (four branches split the 16 heads evenly)
    ladder     the LongNet ladder (2048 .. 32768) / (1 .. 16) at 128k
    dense      the same shapes without dilation: our dense kernel on the whole sequence
TF/s on the dilated FLOPs: sum over branches of segments x (w/r)^2 x 4 x H x D (head_groups: each
branch H/K heads); forward+backward 3.5x. Dense rows count dense FLOPs. --quick: 8k and 32k.

Columns:
    lse              jax_attn.dilated_attention(merge="lse") (the default: Mosaic kernels on Hopper)
    lse_triton       the same, implementation="triton" (the Triton kernels)
    composite        per branch: gather the dilated rows (jnp), jax_attn.flash_attention(return_lse=True)
                     on the segment batch, scatter back; LSE merge (differentiable throughout)
    composite_cudnn  the same with cuDNN (jax's cuDNN fused attention, which returns its softmax
                     statistic through a private entry point); absent where that does not run
    head_groups      jax_attn.dilated_attention(merge="head_groups") (groups4; not compared: the
                     case's relerr reference is the lse composite's)
    groups_composite, groups_cudnn   the head_groups composites (per branch its heads, no merge)
    dense            jax_attn.flash_attention on the whole sequence (dense rows only; the default)
    dense_triton     the same, implementation="triton"
    dense_mask       the original project's path: dense attention with an [H, S, S] dilation mask
                     (jax.nn.dot_product_attention, XLA), S <= --mask-max-seq
    torch_ref        torch_ref.dilated_attention(merge="lse") (the Triton twin)
    torch_composite  per branch: gather (torch), SDPA's flash kernel with its logsumexp, scatter, LSE
                     merge (the logsumexp is not differentiated by torch: the weights are constants
                     in its backward)
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Absent, Case, Column  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

CONFIG = ((2048, 4096, 8192), (1, 2, 4))
CONFIG4 = ((2048, 4096, 8192, 16384), (1, 2, 4, 8))
LADDER = ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16))


@dataclasses.dataclass
class DilatedCase(Case):
    """A case whose FLOPs are the dilated ones (params: segments, rates, merge; head_groups: each
    branch a 1/K share of the heads)."""

    def flops(self, mode: str) -> float:
        if "segments" not in self.params:
            return super().flops(mode)
        total = 0.0
        for w, r in zip(self.params["segments"], self.params["rates"]):
            w = min(w, self.S)
            total += -(-self.S // w) * (w / r) ** 2 * 4 * self.H * self.D
        if self.params.get("merge") == "head_groups":
            total /= len(self.params["segments"])
        return total * (3.5 if mode == "fwdbwd" else 1.0) * self.B


def cases(opts):
    if opts.smoke:
        return [DilatedCase("dilated", 1, 256, 4, 64, params={"segments": (64, 128), "rates": (1, 2)}),
                DilatedCase("groups", 1, 256, 4, 64, params={"segments": (64, 128), "rates": (1, 2),
                                                             "merge": "head_groups"}),
                DilatedCase("dense", 1, 256, 4, 64)]
    lengths = opts.lengths or ((8192, 32768) if opts.quick else (8192, 32768, 131072))
    out = []
    for s in lengths:  # each length's dense row beside its dilated one
        out.append(DilatedCase("dilated", 1, s, 16, 128, params={"segments": CONFIG[0], "rates": CONFIG[1]}))
        out.append(DilatedCase("dense", 1, s, 16, 128))
    out.append(DilatedCase("dilated4", 1, 32768, 16, 128, params={"segments": CONFIG4[0], "rates": CONFIG4[1]}))
    out.append(DilatedCase("groups4", 1, 32768, 16, 128,
                           params={"segments": CONFIG4[0], "rates": CONFIG4[1], "merge": "head_groups"}))
    if not opts.quick:
        out.append(DilatedCase("ladder", 1, 131072, 16, 128, params={"segments": LADDER[0], "rates": LADDER[1]}))
    return out


def _dilated_only(case):
    if "segments" not in case.params:
        raise Absent("dilated columns run on the dilated cases")


def ours(merge, implementation=None):
    def build(case, opts):
        _dilated_only(case)
        _check_groups(case, merge)
        import jax_attn
        return lambda q, k, v: jax_attn.dilated_attention(q, k, v, segment_lengths=case.params["segments"],
                                                          dilation_rates=case.params["rates"], merge=merge,
                                                          implementation=implementation)
    return build


def _branch_geometry(case, w, r):
    """(segments, rows per segment, per-head offsets) of a branch; the composites take S % w == 0."""
    w = min(w, case.S)
    if case.S % w or w % r:
        raise Absent("the composites are written for lengths that divide (S % w == 0, w % r == 0)")
    return case.S // w, w // r, np.arange(case.H) % r


def _check_groups(case, merge):
    if case.params.get("merge", "lse") != merge:
        raise Absent(f"a {merge} column: this case is merge={case.params.get('merge', 'lse')!r}")


def composite(attend, merge="lse"):
    """Per branch: gather each head's dilated rows, attend on the segment batch, scatter, LSE merge
    (head_groups: each branch its group of heads, at offset k mod r, no merge).
    attend(q, k, v) on [B', L, H, D] -> (o [B', L, H, D], lse [B', H, L])."""
    def build(case, opts):
        _dilated_only(case)
        _check_groups(case, merge)
        geo = [(_branch_geometry(case, w, r), r) for w, r in zip(case.params["segments"], case.params["rates"])]
        heads = np.arange(case.H)

        def groups(q, k, v):
            B, S, H, D = q.shape
            size = H // len(geo)
            outs = []
            for i, ((n, L, _), r) in enumerate(geo):
                own = slice(i * size, (i + 1) * size)
                gather = lambda x: x.reshape(B, n, L, r, H, D)[:, :, :, i % r, own].reshape(B * n, L, size, D)
                o, _ = attend(gather(q), gather(k), gather(v))
                o_full = jnp.zeros((B, n, L, r, size, D), o.dtype).at[:, :, :, i % r].set(o.reshape(B, n, L, size, D))
                outs.append(o_full.reshape(B, S, size, D))
            return jnp.concatenate(outs, axis=2)

        def f(q, k, v):
            B, S, H, D = q.shape
            outs, lses = [], []
            for (n, L, offs), r in geo:
                gather = lambda x: x.reshape(B, n, L, r, H, D)[:, :, :, offs, heads, :].reshape(B * n, L, H, D)
                o, lse = attend(gather(q), gather(k), gather(v))
                o_full = jnp.zeros((B, n, L, r, H, D), o.dtype).at[:, :, :, offs, heads, :].set(
                    o.reshape(B, n, L, H, D))
                lse_t = lse.reshape(B, n, H, L).transpose(0, 1, 3, 2)  # [B, n, L, H]
                lse_full = jnp.full((B, n, L, r, H), -jnp.inf, jnp.float32).at[:, :, :, offs, heads].set(lse_t)
                outs.append(o_full.reshape(B, S, H, D))
                lses.append(lse_full.reshape(B, S, H))
            m = jnp.max(jnp.stack(lses), axis=0)
            weights = [jnp.exp(l - m) for l in lses]
            total = sum(weights)
            out = sum(w[..., None] * o.astype(jnp.float32) for w, o in zip(weights, outs)) / total[..., None]
            return out.astype(q.dtype)
        return groups if merge == "head_groups" else f
    return build


def flash_lse(q, k, v):
    import jax_attn
    return jax_attn.flash_attention(q, k, v, return_lse=True)


def cudnn_lse(q, k, v):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    out, stat = cudnn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, return_residual=True)
    return out, stat.astype(jnp.float32).reshape(q.shape[0], q.shape[2], q.shape[1])


def composite_cudnn(merge="lse"):
    def build(case, opts):
        if opts.smoke:
            raise Absent("cuDNN: GPU only")
        try:
            from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401
        except Exception as e:  # noqa: BLE001
            raise Absent(f"jax's cuDNN fused attention does not import: {e}") from e
        return composite(cudnn_lse, merge)(case, opts)
    return build


def dense(implementation=None):
    def build(case, opts):
        if "segments" in case.params:
            raise Absent("dense runs on the dense cases")
        import jax_attn
        return lambda q, k, v: jax_attn.flash_attention(q, k, v, implementation=implementation)
    return build


def dilation_mask(S, H, segments, rates):
    """[H, S, S] bool: key j visible to query i under some branch (the original project's mask)."""
    i = np.arange(S)
    mask = np.zeros((H, S, S), bool)
    for w, r in zip(segments, rates):
        w = min(w, S)
        for h in range(H):
            kept = (i % w) % r == h % r
            same = (i[:, None] // w) == (i[None, :] // w)
            mask[h] |= same & kept[:, None] & kept[None, :]
    return mask


def dense_mask(case, opts):
    _dilated_only(case)
    _check_groups(case, "lse")
    if case.S > opts.mask_max_seq:
        gb = case.H * case.S * case.S * (1 + 4) / 2 ** 30
        raise Absent(f"S={case.S} over --mask-max-seq {opts.mask_max_seq}: the [H, S, S] mask and fp32 "
                     f"scores take about {gb:.0f} GiB")
    mask = jnp.asarray(dilation_mask(case.S, case.H, case.params["segments"], case.params["rates"]))[None]
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def torch_ref_build(case, opts):
    _dilated_only(case)
    _check_groups(case, "lse")
    torch_ref, why = harness.optional_import("torch_ref")
    if torch_ref is None or not hasattr(torch_ref, "dilated_attention"):
        raise Absent(f"torch_ref.dilated_attention does not import: {why}")
    impl = "eager" if opts.smoke else "triton"
    return lambda q, k, v: torch_ref.dilated_attention(q, k, v, segment_lengths=case.params["segments"],
                                                       dilation_rates=case.params["rates"], implementation=impl)


def torch_composite(case, opts):
    _dilated_only(case)
    _check_groups(case, "lse")
    torch, _, why = harness.torch_modules()
    if torch is None:
        raise Absent(f"torch does not import: {why}")
    if opts.smoke:
        raise Absent("SDPA's flash kernel: GPU only")
    geo = [(_branch_geometry(case, w, r), r) for w, r in zip(case.params["segments"], case.params["rates"])]
    heads = torch.arange(case.H)

    def f(q, k, v):
        B, S, H, D = q.shape
        outs, lses = [], []
        for (n, L, offs), r in geo:
            offs_t = torch.as_tensor(offs)

            def gather(x):  # -> [B*n, H, L, D] for SDPA
                x = x.reshape(B, n, L, r, H, D)[:, :, :, offs_t, heads, :]
                return x.reshape(B * n, L, H, D).transpose(1, 2)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention(gather(q), gather(k), gather(v))[:2]
            o_full = q.new_zeros((B, n, L, r, H, D))
            o_full[:, :, :, offs_t, heads, :] = o.transpose(1, 2).reshape(B, n, L, H, D)
            lse_full = torch.full((B, n, L, r, H), float("-inf"), device=q.device)
            lse_full[:, :, :, offs_t, heads] = lse.reshape(B, n, H, L).transpose(2, 3).float()
            outs.append(o_full.reshape(B, S, H, D))
            lses.append(lse_full.reshape(B, S, H))
        m = torch.stack(lses).amax(0)
        weights = [torch.exp(l - m) for l in lses]
        total = sum(weights)
        return (sum(w[..., None] * o.float() for w, o in zip(weights, outs)) / total[..., None]).to(q.dtype)
    return f


COLUMNS = [
    Column("lse", ours("lse")),
    Column("lse_triton", ours("lse", "triton")),
    Column("composite", composite(flash_lse)),
    Column("composite_cudnn", composite_cudnn()),
    Column("head_groups", ours("head_groups"), compare=False),
    Column("groups_composite", composite(flash_lse, "head_groups"), compare=False),
    Column("groups_cudnn", composite_cudnn("head_groups"), compare=False),
    Column("dense", dense(), compare=False),
    Column("dense_triton", dense("triton"), compare=False),
    Column("dense_mask", dense_mask, compare=False, quick=False),
    Column("torch_ref", torch_ref_build, framework="torch"),
    Column("torch_composite", torch_composite, framework="torch"),
]


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="comma-separated sequence lengths of the dilated and dense cases (default 8k, 32k, 128k; "
                        "--quick 8k, 32k)")
    p.add_argument("--mask-max-seq", type=int, default=8192, help="longest S of the dense-mask column")
    opts = harness.finish_options(p.parse_args(argv))
    cs = harness.select(cases(opts), opts.cases, key=lambda c: c.tag, what="case")
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    doc, stem = harness.new_document("dilated", opts, anchors={})
    harness.run("dilated", cs, columns, opts, reference=harness.pick(COLUMNS, "composite", "lse"),
                doc=doc, path=stem + ".json")
    harness.finish(doc, stem, [c.name for c in columns], opts, metric="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
