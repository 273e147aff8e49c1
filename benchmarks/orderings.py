#!/usr/bin/env python3
"""Space-filling-curve orderings inside the kernels: what the fused index map costs, and what the
ordering buys in locality.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/orderings.py --out benchmarks/results [--quick]
    PYTHONPATH=. python3 benchmarks/orderings.py --locality-only      (CPU, NumPy: the locality table)

Cases (bf16, B=1, 16 heads of 128, forward and forward+backward):
    window        flash_attention, window (256, 255) (512 keys), 32k tokens as a 128 x 256 patch grid
    window_causal the same window left of the query (512, 0), causal on the original order
    dilated       dilated_attention, segments (2048, 4096, 8192), rates (1, 2, 4), 32k tokens
    project512    the original project's case: B=2, 512 tokens, 8 heads of 32 (hidden 256),
                  segment 128, dilation 2, every ordering (grid 16 x 32)
TF/s on the visible pairs: window S x (left + right + 1) x 4 x H x D (causal: the pairs with
j <= i are about half; counted whole), dilated the LongNet branch FLOPs (benchmarks/dilated.py);
forward+backward 3.5x. --quick (a smoke run, about 2 minutes; --budget 110 unless given):
project512 first, then window and dilated at 32k with identity, hilbert, composite, torch_hilbert.

Columns:
    identity          no ordering, implementation="triton" (the same kernels without the gather)
    identity_default  no ordering, the default implementation (Mosaic GPU kernels on Hopper)
    hilbert, zorder, snake, gray, bit_reversal
                      ordering=<name> (grid from the case): the kernels gather every tile's rows
                      through the permutation and scatter the results back
    composite         the explicit composite a user writes otherwise: jnp.take q, k, v into the
                      Hilbert order, the unordered kernels (implementation="triton"), jnp.take the
                      output back (non-causal cases only: the plain kernels cannot compare
                      original positions)
    composite_default the same around the default kernels (Mosaic on Hopper)
    torch_identity, torch_hilbert, torch_composite   the torch_ref twins (Triton kernels)

Locality (CPU, NumPy; printed, and saved as locality-<grid>.json beside the results): on a 128 x 128
patch grid, for each ordering, the mean fraction of a token's 256 nearest grid neighbours (Euclidean,
ties by row-major index, the token itself included) that a 1-D window of 256 ordered positions
around it (t - 128 .. t + 127, shifted inside the sequence) covers; the same for a dilated segment
of 512 ordered positions at rate 2 (the 256 kept rows of the token's segment and offset); and the
mean bounding box (rows x cols) of the 64 aligned windows of 256 consecutive ordered tokens.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  (before jax: allocator and platform settings)
from benchmarks.harness import Absent, Case, Column  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attn_spec import orderings  # noqa: E402

DILATED = ((2048, 4096, 8192), (1, 2, 4))
NAMES = ("hilbert", "zorder", "snake", "gray", "bit_reversal")


# ------------------------------------------------------------------------------------------------
# Locality on a patch grid (NumPy, CPU)
# ------------------------------------------------------------------------------------------------

def _neighbours(grid, k: int) -> np.ndarray:
    """[n, k] int: each cell's k nearest cells (Euclidean, ties by row-major index; itself first)."""
    rows, cols = grid
    reach = int(np.ceil(np.sqrt(k))) + 2  # the k nearest lie within this box even at a corner
    dr, dc = np.meshgrid(np.arange(-reach, reach + 1), np.arange(-reach, reach + 1), indexing="ij")
    dr, dc = dr.ravel(), dc.ravel()
    r, c = np.divmod(np.arange(rows * cols), cols)
    nr, nc = r[:, None] + dr[None, :], c[:, None] + dc[None, :]
    inside = (nr >= 0) & (nr < rows) & (nc >= 0) & (nc < cols)
    index = np.where(inside, nr * cols + nc, rows * cols)
    # sort key: squared distance, then the row-major index (outside the grid: last)
    key = np.where(inside, (dr * dr + dc * dc)[None, :] * (rows * cols + 1) + index, np.iinfo(np.int64).max)
    part = np.argpartition(key, k - 1, axis=1)[:, :k]
    return np.take_along_axis(index, part, axis=1)


def locality(grid=(128, 128), window: int = 256, names=("identity",) + NAMES) -> dict:
    """{ordering: {"window_coverage", "dilated_coverage", "bbox_rows", "bbox_cols", "bbox_area"}}."""
    n = grid[0] * grid[1]
    knn = _neighbours(grid, window)
    out = {}
    for name in names:
        perm = orderings.permutation(name, n, grid)
        inv = orderings.inverse(perm)
        t = inv  # each token's ordered position
        start = np.clip(t - window // 2, 0, n - window)
        rank = inv[knn]  # ordered positions of each token's neighbours
        in_window = (rank >= start[:, None]) & (rank < start[:, None] + window)
        seg, rate = 2 * window, 2  # a dilated segment of 2 * window positions at rate 2: window kept rows
        same_seg = (rank // seg == (t // seg)[:, None]) & (rank % rate == (t % rate)[:, None])
        r, c = np.divmod(perm.reshape(-1, window).astype(np.int64), grid[1])
        rows_spanned = r.max(1) - r.min(1) + 1
        cols_spanned = c.max(1) - c.min(1) + 1
        out[name] = {"window_coverage": float(in_window.mean()), "dilated_coverage": float(same_seg.mean()),
                     "bbox_rows": float(rows_spanned.mean()), "bbox_cols": float(cols_spanned.mean()),
                     "bbox_area": float((rows_spanned * cols_spanned).mean())}
    return out


def locality_table(results: dict, grid, window: int) -> str:
    lines = [f"Locality on a {grid[0]} x {grid[1]} patch grid: share of each token's {window} nearest grid "
             f"neighbours covered by a 1-D window of {window} ordered positions, by a dilated segment of "
             f"{2 * window} at rate 2, and the mean bounding box of {window} consecutive ordered tokens.", "",
             "| ordering | window coverage | dilated segment coverage | bbox rows x cols | bbox area |",
             "|---|---|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {m['window_coverage']:.3f} | {m['dilated_coverage']:.3f} | "
                     f"{m['bbox_rows']:.1f} x {m['bbox_cols']:.1f} | {m['bbox_area']:.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class OrderCase(Case):
    """params: kind ("window" | "dilated"), grid, window or segments/rates."""

    def flops(self, mode: str) -> float:
        p = self.params
        if p["kind"] == "window":
            left, right = p["window"]
            total = self.S * (left + right + 1) * 4 * self.H * self.D
        else:
            total = 0.0
            for w, r in zip(p["segments"], p["rates"]):
                w = min(w, self.S)
                total += -(-self.S // w) * (w / r) ** 2 * 4 * self.H * self.D
        return total * (3.5 if mode == "fwdbwd" else 1.0) * self.B


def cases(opts):
    if opts.smoke:
        return [OrderCase("window", 1, 256, 2, 32, params={"kind": "window", "window": (16, 15), "grid": (16, 16)}),
                OrderCase("dilated", 1, 256, 2, 32, params={"kind": "dilated", "segments": (64, 128),
                                                            "rates": (1, 2), "grid": (16, 16)})]
    grid = (128, 256)
    project = OrderCase("project512", 2, 512, 8, 32, params={"kind": "dilated", "segments": (128,), "rates": (2,),
                                                              "grid": (16, 32)})
    out = [OrderCase("window", 1, 32768, 16, 128, params={"kind": "window", "window": (256, 255), "grid": grid}),
           OrderCase("dilated", 1, 32768, 16, 128, params={"kind": "dilated", "segments": DILATED[0],
                                                           "rates": DILATED[1], "grid": grid})]
    if not opts.quick:
        out.insert(1, OrderCase("window_causal", 1, 32768, 16, 128, causal=True,
                                params={"kind": "window", "window": (512, 0), "grid": grid}))
    return [project] + out if opts.quick else out + [project]


def _kwargs(case) -> dict:
    p = case.params
    if p["kind"] == "window":
        return dict(window=p["window"], causal=case.causal)
    return dict(segment_lengths=p["segments"], dilation_rates=p["rates"], causal=case.causal)


def _call(lib, case):
    return lib.flash_attention if case.params["kind"] == "window" else lib.dilated_attention


def ours(ordering, implementation="triton"):
    def build(case, opts):
        if ordering not in (None, "hilbert") and case.tag != "project512" and opts.quick:
            raise Absent("--quick: this ordering on the original project's case only")
        import jax_attn
        f, kw = _call(jax_attn, case), _kwargs(case)
        extra = {} if ordering is None else dict(ordering=ordering, grid=case.params["grid"])
        return lambda q, k, v: f(q, k, v, implementation=implementation, **kw, **extra)
    return build


def composite(implementation):
    def build(case, opts):
        if case.causal:
            raise Absent("the plain kernels cannot compare original positions (causal under an ordering)")
        import jax_attn
        f, kw = _call(jax_attn, case), _kwargs(case)
        perm = jnp.asarray(orderings.permutation("hilbert", case.S, case.params["grid"]))
        inv = jnp.asarray(orderings.inverse(np.asarray(perm)))

        def g(q, k, v):
            take = lambda x: jnp.take(x, perm, axis=1)
            return jnp.take(f(take(q), take(k), take(v), implementation=implementation, **kw), inv, axis=1)
        return g
    return build


def torch_build(mode):
    def build(case, opts):
        torch_ref, why = harness.optional_import("torch_ref")
        if torch_ref is None:
            raise Absent(f"torch_ref does not import: {why}")
        if opts.smoke:
            raise Absent("torch Triton: GPU only here")
        torch = harness.torch_modules()[0]
        f, kw = _call(torch_ref, case), _kwargs(case)
        grid = case.params["grid"]
        if mode == "identity":
            return lambda q, k, v: f(q, k, v, implementation="triton", **kw)
        if mode == "hilbert":
            return lambda q, k, v: f(q, k, v, implementation="triton", ordering="hilbert", grid=grid, **kw)
        if case.causal:
            raise Absent("the plain kernels cannot compare original positions (causal under an ordering)")
        perm = torch.as_tensor(orderings.permutation("hilbert", case.S, grid).astype(np.int64))
        inv = torch.as_tensor(orderings.inverse(perm.numpy()).astype(np.int64))

        def g(q, k, v):
            p, i = perm.to(q.device), inv.to(q.device)
            take = lambda x: x.index_select(1, p)
            return f(take(q), take(k), take(v), implementation="triton", **kw).index_select(1, i)
        return g
    return build


COLUMNS = [
    Column("identity", ours(None)),
    Column("identity_default", ours(None, None), compare=False, quick=False),
    *(Column(name, ours(name), compare=name == "hilbert") for name in NAMES),
    Column("composite", composite("triton")),
    Column("composite_default", composite(None), quick=False),
    Column("torch_identity", torch_build("identity"), framework="torch", compare=False, quick=False),
    Column("torch_hilbert", torch_build("hilbert"), framework="torch"),
    Column("torch_composite", torch_build("composite"), framework="torch", quick=False),
]


def main(argv=None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--locality-only", action="store_true", help="the NumPy locality table alone (CPU)")
    p.add_argument("--locality-grid", default="128x128", help="the patch grid of the locality table")
    p.add_argument("--locality-window", type=int, default=256)
    args = p.parse_args(argv)
    if args.quick and args.budget is None:
        args.budget = 110.0
    opts = harness.finish_options(args)
    grid = tuple(int(x) for x in opts.locality_grid.split("x"))
    if opts.smoke and opts.locality_grid == "128x128":
        grid = (32, 32)
    window = 64 if opts.smoke else opts.locality_window
    loc = locality(grid, window)
    table = locality_table(loc, grid, window)
    print(table, flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"locality-{grid[0]}x{grid[1]}-w{window}.json"), "w") as f:
        json.dump({"grid": grid, "window": window, "orderings": loc}, f, indent=1)
    if opts.locality_only:
        return 0
    cs = harness.select(cases(opts), opts.cases, key=lambda c: c.tag, what="case")
    columns = harness.select(COLUMNS, opts.columns, key=lambda c: c.name, quick=opts.quick)
    doc, stem = harness.new_document("orderings", opts, anchors={}, locality={"grid": grid, "window": window,
                                                                             "orderings": loc})
    # the relerr reference: the explicit composite where it runs, else the fused Hilbert column
    harness.run("orderings", cs, columns, opts, reference=harness.pick(COLUMNS, "composite", "hilbert"),
                doc=doc, path=stem + ".json", paired=("identity", "hilbert", "composite"), paired_rounds=3)
    harness.finish(doc, stem, [c.name for c in columns], opts, metric="ms", extra_markdown=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
