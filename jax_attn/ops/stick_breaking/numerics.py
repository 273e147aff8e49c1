"""Stick-breaking's numeric thresholds, shared by its Triton and Mosaic kernels."""
from __future__ import annotations


# Stick-breaking: its 16-bit in-tile softplus suffix terms (base 2) are capped here before the fp16
# rounding (fp16 overflows at 65504); one such term makes every A left of it 2^-256, zero in fp32.
SP_CAP = 256.0


# Stick-breaking: a row whose softplus sum right of a key block reaches SPENT (base 2) has spent its
# stick there: every A left of it is 2^-SPENT or less, exactly 0 in fp32 (2^-150 rounds to 0), so
# the kernels skip those tiles and the results stay bit-equal. On the GPU A is ex2.approx.ftz,
# which flushes results below 2^-126 to 0: there SPENT_FTZ suffices (2 below, for the
# approximation's error).
SPENT = 152.0


SPENT_FTZ = 128.0
