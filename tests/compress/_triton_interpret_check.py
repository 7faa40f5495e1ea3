"""Run by test_triton_interpret.py in a subprocess with TRITON_INTERPRET=1.

The interpreter must be chosen before triton is first imported (triton.language's own @jit
helpers are decorated at import), so this cannot run inside the pytest process. Prints one JSON
object: case id -> "ok" or a description of the first mismatch.
"""
import itertools
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kvtier.compress import reference as R  # noqa: E402
from kvtier.compress import triton_kernels as TK  # noqa: E402

# (shape, group_size): block tails, head_dim 64/128, groups not dividing the dim. Every shape in
# fp16; a subset in bf16 (its rounding is done by hand in the kernels) and fp32, to keep the
# interpreter's run short.
ALL = [((3, 64, 64), 64), ((2, 37, 128), 32), ((5, 80), 32), ((1, 7, 3), 128), ((2, 2, 65, 64), 128)]
CASES = {
    "float16": ALL,
    "bfloat16": [ALL[0], ALL[1], ALL[3]],
    "float32": [ALL[2], ALL[4]],
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def compare(x, bits, G, axis):
    ref = R.quantize_ref(x, bits, G, axis)
    got = TK.quantize(x, bits, G, axis)
    for name, a, b in zip(("q", "scale", "zero"), ref, got):
        if (a is None) != (b is None):
            return f"{name}: one side is None"
        if a is None:
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            return f"{name}: {(a != b).sum().item()} elements differ"
    shape = tuple(x.shape)
    ya = R.dequantize_ref(*ref, bits, G, axis, shape, x.dtype)
    yb = TK.dequantize(*ref, bits, G, axis, shape, x.dtype)
    if not torch.equal(ya, yb):
        return f"dequantized: {(ya != yb).sum().item()} elements differ"
    return "ok"


# plain int8, int4, int2, and int8 with a zero point (uint8 codes), labelled "int8z"
BITS = {"int8": 8, "int4": 4, "int2": 2, "int8z": R.ASYM8}


def main():
    out = {}
    for (dname, dtype), (label, bits), axis in itertools.product(DTYPES.items(), BITS.items(), ("token", "channel")):
        g = torch.Generator().manual_seed(7 * abs(bits))
        for shape, G in CASES[dname]:
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            if bits == R.ASYM8:
                x = x + torch.randn(shape[-1], generator=g).to(dtype) * 4  # offset channels, where a zero pays
            out[f"{dname}-{label}-{axis}-{'x'.join(map(str, shape))}-g{G}"] = compare(x, bits, G, axis)
    for (label, bits), axis in itertools.product(BITS.items(), ("token", "channel")):
        x = torch.zeros(2, 64, 64, dtype=torch.float16)
        x[1] = -0.5  # constant groups: scale 1, exact round trip
        res = compare(x, bits, 32, axis)
        if res == "ok" and not torch.equal(TK.dequantize(*TK.quantize(x, bits, 32, axis), bits, 32, axis,
                                                         tuple(x.shape), x.dtype), x):
            res = "constant block not reproduced exactly"
        out[f"constant-{label}-{axis}"] = res
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
