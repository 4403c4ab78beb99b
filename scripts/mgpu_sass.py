"""A Mosaic GPU matmul kernel's SASS (W4A16, or with ``--kernel w8a16`` the
weight-only FP8 one) for sm_90a, on a machine without a GPU: its
registers, spills and the opcode mix of its main loop (a pipeline step), for one
shape and setting.

Needs jax >= 0.11 with its CUDA plugin (``pip install "jax[cuda13]"``: Mosaic dumps
the PTX and its ptxas report when asked) and the `triton` wheel's ``cuobjdump`` (``pip
install triton``; only its binary is used). The PTX is assembled by the CUDA plugin's
``ptxas`` (triton's is older than the PTX jax 0.11 writes).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python scripts/mgpu_sass.py --m 16 --n 28672 \\
        --k 4096 [--settings '{"groups_per_step": 2}']

The main loop is the innermost backward branch whose body holds the wgmma (HGMMA)
instructions; its count is per pipeline step (one group of 128 columns, or
``groups_per_step`` of them), for the 128 weight values a thread widens per group.
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*.*?);")


def tool(name: str) -> str:
    if name == "ptxas":
        import nvidia
        hits = glob.glob(os.path.join(os.path.dirname(nvidia.__path__[0]), "nvidia", "cu*",
                                      "bin", "ptxas"))
    else:
        import triton
        hits = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             name)]
    hits = [h for h in hits if os.path.exists(h)]
    if not hits:
        raise SystemExit(f"no {name}: see this script's docstring")
    return hits[0]


def main_loop(sass: str) -> list[str]:
    """The opcodes of the innermost backward branch's body that holds an HGMMA."""
    ins = [(int(a, 16), t) for a, t in INS.findall(sass)]
    best = None
    for addr, text in ins:
        target = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            if any("HGMMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best or []]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--settings", default="{}", help="JSON of the kernel's settings")
    ap.add_argument("--kernel", choices=("w4a16", "w8a16"), default="w4a16")
    args = ap.parse_args()
    settings = json.loads(args.settings)
    with tempfile.TemporaryDirectory() as dump:
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
        import jax
        import jax.numpy as jnp

        from jaxllm.runner import aot
        from pallas_kernels import w4a16_mgpu as w4
        from pallas_kernels import w8a16_mgpu as w8
        with open(os.path.join(ROOT, "configs", "gpu_targets", "h200.txtpb")) as f:
            mesh = aot.target_mesh(f.read())
        sd = jax.ShapeDtypeStruct
        if args.kernel == "w8a16":
            kernel = w8.w8a16_matmul
            shapes = (sd((args.m, args.k), jnp.float16), sd((args.n, args.k), w8.FP8),
                      sd((args.n,), jnp.float32))
        else:
            kernel = w4.w4a16_matmul
            shapes = (sd((args.m, args.k), jnp.bfloat16), sd((args.n, args.k), jnp.int4),
                      sd((2 * args.k // w4.GROUP, args.n), jnp.bfloat16))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            fn = jax.jit(functools.partial(kernel, **settings))
            fn.lower(*aot.on_mesh(shapes, mesh)).compile()
        ptx = sorted(glob.glob(os.path.join(dump, "*.ptx")))
        if not ptx:
            raise SystemExit("Mosaic dumped no PTX (jax >= 0.11 with its CUDA plugin?)")
        for path in ptx:
            cubin = path[:-4] + ".cubin"
            subprocess.run([tool("ptxas"), "-arch=sm_90a", path, "-o", cubin], check=True)
            sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout
            report = open(path[:-4] + ".ptxas").read() if os.path.exists(
                path[:-4] + ".ptxas") else ""
            used = re.search(r"Used \d+ registers.*", report)
            spills = re.search(r"\d+ bytes spill stores", report)
            loop = main_loop(sass)
            mix = collections.Counter(loop).most_common(14)
            print(f"{os.path.basename(path)}: {used.group(0) if used else '?'}; "
                  f"{spills.group(0) if spills else '?'}")
            print(f"  main loop {len(loop)} instructions: "
                  + " ".join(f"{op} {n}" for op, n in mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
