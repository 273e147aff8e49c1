"""Dump the traced jaxprs (forward + backward) of a fixed set of kernel configurations, one file each,
to compare two trees: a refactor that must not change the kernels leaves every file identical.

  python scripts/trace_kernels.py OUT_DIR        (then: diff -r BEFORE_DIR OUT_DIR)

Covers the Triton engine, the Mosaic GPU kernels (traced for a pretended Hopper device) and
stick-breaking, interpreted and compiled, fp32 / fp16 / bf16, with masks, segment ids, softcap, RoPE in
both styles, positions and GQA. Pallas source locations are normalised out."""
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_attn
from jax_attn.ops.common.rope import Rope
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.softmax import mosaic as MG
from jax_attn.ops.softmax import triton as PT
from jax_attn.ops.stick_breaking import triton as SBP

MG.device_info = lambda *a: jax_attn.DeviceInfo("gpu", "NVIDIA H100", (9, 0), None, 132)  # trace the Hopper kernels


def flash(**kw):
    return PT.flash_attention_pallas(**kw)


def sb(**kw):
    return SBP.stick_breaking_pallas(**kw)


def dump(name, f, args):
    """One file: the jaxpr of f's forward and its vjp with ones as cotangents."""
    def full(*a):
        out, vjp = jax.vjp(f, *a)
        cts = jax.tree.map(lambda x: jnp.ones_like(x), out)
        return out, vjp(cts)
    txt = str(jax.make_jaxpr(full)(*args))
    txt = re.sub(r"name_and_src_info=[^\n]*?(?=\n|  [a-z_]+=)", "name_and_src_info=X", txt)
    txt = re.sub(r"at /[^ \]\)]*:\d+", "at X", txt)
    with open(os.path.join(sys.argv[1], f"{name}.txt"), "w") as out:
        out.write(txt)
S = 200
def qkv(hq, hkv, d, dt, sq=S, sk=S):
    r = np.random.default_rng(0)
    return [jnp.asarray(r.standard_normal(s), dt) for s in ((2, sq, hq, d), (2, sk, hkv, d), (2, sk, hkv, d))]
for interp in (True, False):
  for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
    for causal, window, seg, cap, rope, pos, gqa in [
        (False, None, False, None, None, False, 1), (True, None, False, None, None, False, 2),
        (True, (17, 5), True, 2.5, None, False, 1), (False, (9, 9), False, None, Rope(style="half"), False, 2),
        (True, None, False, None, Rope(style="interleaved"), True, 1), (True, None, True, None, Rope(style="half"), True, 3),
        (True, None, False, None, Rope(style="half"), False, 1), (True, (33, 0), False, None, Rope(style="interleaved"), False, 2), (True, (40, 0), False, None, None, False, 1)]:
        d = 64 if rope else 72
        prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else jax.lax.Precision.DEFAULT
        spec = AttentionSpec(scale=0.3, causal=causal, window_left=window and window[0], window_right=window and window[1],
                             softcap=cap, has_segments=seg, precision=prec, rope=rope)
        q, k, v = qkv(2 * gqa, 2, d, dt, S, S + (0 if causal else 13))
        ids = (jnp.asarray(np.repeat(np.arange(4), 50)[None].repeat(2, 0)), jnp.asarray(np.repeat(np.arange(4), 54)[None].repeat(2, 0)[:, :k.shape[1]])) if seg else (None, None)
        pp = (jnp.asarray(np.arange(S)[None].repeat(2, 0) + 3), jnp.asarray(np.arange(k.shape[1])[None].repeat(2, 0))) if pos else (None, None)
        name = f"flash-i{int(interp)}-{jnp.dtype(dt).name}-c{int(causal)}-w{window}-s{int(seg)}-cap{cap}-r{rope and rope.style}-p{int(pos)}-g{gqa}"
        dump(name, lambda q, k, v: flash(q=q, k=k, v=v, q_seg=ids[0], kv_seg=ids[1], spec=spec, q_pos=pp[0], kv_pos=pp[1], interpret=interp), (q, k, v))
        if not interp and dt != jnp.float32 and not seg and cap is None and not pos and causal or (not interp and dt == jnp.bfloat16 and not causal and window is None):
            dump("mosaic-" + name, lambda q, k, v: flash(q=q, k=k, v=v, q_seg=None, kv_seg=None, spec=spec, interpret=False, kernels="mosaic_gpu"), (q, k, v))
    for rope, gqa, decay in [(None, 1, 0.0), (Rope(style="half"), 2, 0.1), (Rope(style="interleaved"), 1, 0.0), (None, 4, 0.05)]:
        d = 64 if rope else 48
        prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else jax.lax.Precision.DEFAULT
        spec = AttentionSpec(scale=0.3, causal=True, precision=prec, rope=rope)
        q, k, v = qkv(2 * gqa, 2, d, dt)
        dec = jnp.full((2 * gqa,), decay, jnp.float32)
        name = f"sb-i{int(interp)}-{jnp.dtype(dt).name}-r{rope and rope.style}-g{gqa}-d{decay}"
        dump(name, lambda q, k, v, dec: sb(q=q, k=k, v=v, decay=dec, spec=spec, interpret=interp), (q, k, v, dec))
        if not interp and dt != jnp.float32 and rope is None:
            dump("mosaic-" + name, lambda q, k, v, dec: sb(q=q, k=k, v=v, decay=dec, spec=spec, interpret=False, forward="mosaic_gpu"), (q, k, v, dec))
print("done")
