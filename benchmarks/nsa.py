#!/usr/bin/env python3
"""Native Sparse Attention: this library's NSA (whole and its selection branch) beside dense causal attention.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/nsa.py --out benchmarks/results [--quick]

Cases (bf16, B=1, D=128, causal, forward and forward+backward; 16, 64 and 128k tokens):
    heads    64 query / 4 kv heads (GQA 16, the paper's) and 16 / 16 (ratio 1)
    nsa      16 selected blocks of 64; compression 32/16 or 64/64 (block/stride); window 512 or 0
    dense    the same shapes, dense causal (the anchors)
    ranges   ranges_R1 and ranges_R8 (see the ranges columns; seconds, also in --quick)
--lengths and --heads narrow the grid (e.g. --lengths 65536 --heads 16/16). --quick: 16k and 64k,
64/4 heads, compression 32/16 with window 512 (and at 64k 64/64 with window 0, fla's setting), the
dense anchors, the quick columns; meant to stay within two minutes. --smoke: tiny shapes on the CPU.

Columns:
    nsa          jax_attn.nsa_attention (the default implementation: the selection and importance
                 kernels, the flash engine for the compression and window branches); gates 0.5
    selection    jax_attn.selection_attention alone on a fixed NSA-like selection (block 0, the
                 two local blocks, 13 random blocks within the frontier)
    selection_step1  the same visiting by tokens (NSABlockSizes(visit="tokens"), the default
                 above 4 heads a kv head, by blocks up to it) with dK/dV steps of one token's
                 group rows (tokens_dkdv=1; the default gathers about 64 rows of several tokens)
    selection_wide the same visiting by tokens with forward / dQ tiles of about 64 rows (tokens x
                 heads) walking the union of their tokens' blocks (the default: 16 rows)
    fla          fla-org's parallel_nsa (torch), where it imports and takes the case (it needs
                 16+ query heads per kv head; compression 64/64 is its own)
    cudnn        jax.nn.dot_product_attention(implementation="cudnn"), full causal (dense rows)
    flash        jax_attn.flash_attention(causal=True) (dense rows; Mosaic kernels on Hopper)
    ranges       the ranges cases (ranges_R1, ranges_R8: the original project's "N=1024, H=8,
                 D=128, L=256 against SDPA": 1024 tokens, 8 query heads on one kv head, 256 keys
                 per row as R disjoint [start, end) ranges at arbitrary starts, not causal):
                 jax_attn.selection_attention(ranges=..., causal=False)
    ranges_sdpa_mask   jax.nn.dot_product_attention with the equivalent boolean mask
    ranges_sdpa_dense  jax.nn.dot_product_attention over all keys (no mask), the second anchor
Every array a column needs besides q, k, v (block lists, gates) is an argument of the jitted
function (`harness.WithArgs`), never closed over: a closed-over block list is a compile-time
constant, and XLA spent about two minutes folding the canonicalising sort over it.
FLOPs: NSA rows count the three branches' attention FLOPs (4*S*H*D times, per query, the
compressed keys it sees on average + the selected keys + the window), dense rows the causal
formula; forward+backward 3.5x. The table reports ms.
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

SELECT_BLOCK, NUM_SELECTED = 64, 16


@dataclasses.dataclass
class NSACase(Case):
    """An NSA case (params: compress, stride, window; select_block, num_selected) or a dense one."""

    def flops(self, mode: str) -> float:
        p = self.params
        if "ranges" in p:  # the ranges case: `keys` keys per row
            return 4 * self.B * self.S * p["keys"] * self.H * self.D * (3.5 if mode == "fwdbwd" else 1.0)
        if "compress" not in p:
            return super().flops(mode)
        from attn_spec import nsa
        count = nsa.compressed_count(self.S, p["compress"], p["stride"])
        seen_cmp = count / 2  # block-causal: on average half the compressed keys
        seen = seen_cmp + min(self.S / 2, p["num_selected"] * p["select_block"]) + min(self.S / 2, p["window"])
        return 4 * self.B * self.S * seen * self.H * self.D * (3.5 if mode == "fwdbwd" else 1.0)


def ranges_cases(opts):
    """The original project's ranges case (N=1024 tokens, H=8 query heads on one kv head, D=128,
    L=256 keys per row as R disjoint ranges, not causal), R = 1 and 8."""
    n, h, d, keys = (64, 2, 32, 16) if opts.smoke else (1024, 8, 128, 256)
    return [NSACase(f"ranges_R{r}", 1, n, h, d, causal=False, kv_heads=1, params=dict(ranges=r, keys=keys))
            for r in ((1, 4) if opts.smoke else (1, 8))]


def cases(opts):
    if opts.smoke:
        small = dict(compress=16, stride=8, window=16, select_block=16, num_selected=4)
        return [NSACase("nsa", 1, 256, 4, 64, causal=True, kv_heads=1, params=small),
                NSACase("dense", 1, 256, 4, 64, causal=True, kv_heads=1)] + ranges_cases(opts)
    lengths = (16384, 65536) if opts.quick else (16384, 65536, 131072)
    heads = ((64, 4),) if opts.quick else ((64, 4), (16, 16))
    if opts.lengths:
        lengths = tuple(int(x) for x in opts.lengths.split(","))
    if opts.heads:
        heads = tuple(tuple(int(y) for y in x.split("/")) for x in opts.heads.split(","))
    settings = ((32, 16, 512), (32, 16, 0), (64, 64, 512), (64, 64, 0))
    out = []
    for s in lengths:
        for h, hkv in heads:
            # --quick: the target setting at both lengths, fla's setting at 64k
            chosen = [c for c in settings if not opts.quick or c == (32, 16, 512) or (s == 65536 and c == (64, 64, 0))]
            for compress, stride, window in chosen:
                out.append(NSACase(f"nsa_c{compress}s{stride}_w{window}", 1, s, h, 128, causal=True, kv_heads=hkv,
                                   params=dict(compress=compress, stride=stride, window=window,
                                               select_block=SELECT_BLOCK, num_selected=NUM_SELECTED)))
            out.append(NSACase("dense", 1, s, h, 128, causal=True, kv_heads=hkv))
    return out + ranges_cases(opts)


def _nsa_only(case):
    if "compress" not in case.params:
        raise Absent("NSA columns run on the NSA cases")


def _dense_only(case):
    if "compress" in case.params or "ranges" in case.params:
        raise Absent("dense columns run on the dense rows (the same shapes)")


def _ranges_only(case):
    if "ranges" not in case.params:
        raise Absent("ranges columns run on the ranges cases")


def random_ranges(case, seed=0):
    """int32 [B, S, Hkv, R, 2]: per row R disjoint ranges of keys / R keys at arbitrary starts,
    one in each of R equal windows of the sequence (the torch twin's `_random_ranges`)."""
    r, keys = case.params["ranges"], case.params["keys"]
    width, span = keys // r, case.S // r
    rng = np.random.default_rng(seed)
    start = rng.integers(0, span - width + 1, (case.B, case.S, case.Hkv, r)) + np.arange(r) * span
    return np.stack([start, start + width], axis=-1).astype(np.int32)


def ranges_column(case, opts):
    _ranges_only(case)
    import jax_attn
    return harness.WithArgs(lambda q, k, v, ranges: jax_attn.selection_attention(q, k, v, ranges=ranges, causal=False),
                            (jax.device_put(random_ranges(case)),))


def ranges_mask_column(case, opts):
    _ranges_only(case)
    ranges = random_ranges(case)
    keys = np.arange(case.S)
    inside = (keys >= ranges[..., 0:1]) & (keys < ranges[..., 1:2])  # [B, S, Hkv, R, S]
    mask = inside.any(3).transpose(0, 2, 1, 3)  # [B, Hkv = 1, S, S]: broadcast over the heads
    return harness.WithArgs(lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask),
                            (jax.device_put(mask),))


def ranges_dense_column(case, opts):
    _ranges_only(case)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v)


def _gates(case, dtype):
    return jax.block_until_ready(jnp.full((case.B, case.S, case.H, 3), 0.5, dtype))


def nsa_column(case, opts):
    _nsa_only(case)
    import jax_attn
    p = case.params
    return harness.WithArgs(lambda q, k, v, gates: jax_attn.nsa_attention(
        q, k, v, gates, compress_block=p["compress"], compress_stride=p["stride"], select_block=p["select_block"],
        num_selected=p["num_selected"], window=p["window"]), (_gates(case, opts.dtype),))


def nsa_like_indices(batch, seq_len, kv_heads, select_block, n, seed=0):
    """int32 [B, S, Hkv, n]: block 0, the two local blocks and n - 3 random blocks within the
    frontier (repeats and -1 where a row sees fewer blocks: the kernels ignore them)."""
    rng = np.random.default_rng(seed)
    own = (np.arange(seq_len) // select_block)[None, :, None]
    idx = np.empty((batch, seq_len, kv_heads, n), np.int32)
    idx[..., 0], idx[..., 1], idx[..., 2] = 0, np.maximum(own - 1, 0), own
    idx[..., 3:] = rng.random((batch, seq_len, kv_heads, n - 3)) * (own[..., None] + 1)
    return idx


def selection_column(config=None):
    def build(case, opts):
        _nsa_only(case)
        import jax_attn
        p = case.params
        idx = jax.device_put(nsa_like_indices(case.B, case.S, case.Hkv, p["select_block"], p["num_selected"]))
        cfg = None if config is None or opts.smoke else config(case)
        return harness.WithArgs(lambda q, k, v, idx: jax_attn.selection_attention(
            q, k, v, idx, block_size=p["select_block"], config=cfg), (idx,))
    return build


def _one_token_steps(case):
    import jax_attn
    return jax_attn.NSABlockSizes(tokens_dkdv=1, visit="tokens")


def _wide_tiles(case):
    import jax_attn
    from attn_spec.tiles import pow2_at_least
    from jax_attn.ops.nsa.triton import tokens_for_group
    tokens = tokens_for_group(pow2_at_least(case.H // case.Hkv, 1), 64)
    return jax_attn.NSABlockSizes(tokens=tokens, tokens_dq=tokens, visit="tokens")


def cudnn_column(case, opts):
    _dense_only(case)
    if opts.smoke:
        raise Absent("cuDNN: GPU only")
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def flash_column(case, opts):
    _dense_only(case)
    import jax_attn
    return lambda q, k, v: jax_attn.flash_attention(q, k, v, causal=True)


def fla_column(case, opts):
    _nsa_only(case)
    torch, _, why = harness.torch_modules()
    if torch is None:
        raise Absent(f"torch does not import: {why}")
    if opts.smoke or not torch.cuda.is_available():
        raise Absent("fla's kernels: GPU only")
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # noqa: BLE001  (optional anchor)
        raise Absent(f"fla.ops.nsa.parallel_nsa does not import: {harness.first_line(str(e))}") from e
    p = case.params
    if case.H // case.Hkv < 16:
        raise Absent("fla's parallel_nsa needs 16 or more query heads per kv head")
    if (p["compress"], p["stride"]) != (p["select_block"], p["select_block"]):
        raise Absent("fla compresses with block = stride = its block size (64/64 here)")
    g = torch.full((case.B, case.S, case.H), 0.5, dtype=torch.bfloat16, device="cuda")

    def f(q, k, v):
        # fla >= 0.3: g_cmp given and no block_indices: it compresses, selects and attends itself
        return parallel_nsa(q, k, v, g_cmp=g, g_slc=g, g_swa=g if p["window"] else None,
                            block_counts=p["num_selected"], block_size=p["select_block"], window_size=p["window"])
    return f


COLUMNS = [
    Column("nsa", nsa_column, compare=False),
    Column("selection", selection_column(), compare=False),
    Column("selection_step1", selection_column(_one_token_steps), compare=False, quick=False),
    Column("selection_wide", selection_column(_wide_tiles), compare=False, quick=False),
    Column("fla", fla_column, framework="torch", compare=False),
    Column("cudnn", cudnn_column, compare=False),
    Column("flash", flash_column, compare=False),
    Column("ranges", ranges_column, compare=False),
    Column("ranges_sdpa_mask", ranges_mask_column, compare=False),
    Column("ranges_sdpa_dense", ranges_dense_column, compare=False),
]


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths instead of the default ones")
    p.add_argument("--heads", default=None, help="comma-separated query/kv heads, e.g. 64/4,16/16")
    opts = harness.finish_options(p.parse_args(argv))
    cs = harness.select(cases(opts), opts.cases, key=lambda c: c.tag, what="case")
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    doc, stem = harness.new_document("nsa", opts, anchors={})
    harness.run("nsa", cs, columns, opts, doc=doc, path=stem + ".json")
    harness.finish(doc, stem, [c.name for c in columns], opts, metric="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
