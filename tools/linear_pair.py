"""Time a whole W4A4 linear as a model runs it -- quantize_act, then gemm_w4a4, back to back on one stream -- beside
each operator alone and cuBLAS on the bf16 activations (same run, same GPU), for one or more artifact sets.

    python3 tools/linear_pair.py ARTIFACTS [ARTIFACTS ...] [--m 16,64,256,1024] [--kn 3072x3072,...] [--rank 32]
        [--json F]

The loader's own selection serves every call.  Inputs rotate as in `svdq-aot bench` (one pass over them moves more
than twice the L2); CUDA-graph replays of back-to-back calls, median of the samples.  The GEMM output is checked
once per case against the eager torch pipeline.  Artifact sets alternate per case, so drifting clocks hit them
alike.
"""
from __future__ import annotations

import argparse
import json

import torch

import svdq_loader
from svdq_loader.testing import bench, reference as ref, torch_quant as tq
from svdq_loader.testing.bench_linear import linear_set_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--m", default="16,64,256,1024")
    ap.add_argument("--kn", default="3072x9216,3072x3072,3072x12288,12288x3072,3072x21504,15360x3072")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    st = bench.QUICK
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    libs = [(d, svdq_loader.load(d)) for d in a.artifacts]
    tdt, r = torch.bfloat16, a.rank
    rows = []
    for kn in a.kn.split(","):
        k, n = (int(v) for v in kn.split("x"))
        for m in (int(v) for v in a.m.split(",")):
            p = ref.random_problem(m, n, k, r, seed=m * 31 + k + n, out_dtype="bf16", device="cuda")
            nset = bench.n_sets_for(linear_set_bytes(m, k, n, r), l2)
            x, smooth, ld = bench._quant_inputs(m, k, r, tdt, seed=m + k)
            xs = [x] + [x.clone() for _ in range(nset - 1)]
            dense = bench._dense_case(m, k, n, tdt, st, l2)["us"]
            row = dict(m=m, k=k, n=n, cublas_us=dense)
            for d, lib in libs:
                ws = [lib.prepare_weight(p["wgt"].clone(), p["wscales"].clone(), lora_up=p["lora_up"],
                                         wcscale=p["wcscale"], bias=p["bias"]) for _ in range(nset)]
                q = [lib.quantize_act(xs[i], smooth=smooth, lora_down=ld) for i in range(nset)]
                outs = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in range(nset)]

                def gemm(i):
                    act, sc, la = q[i]
                    lib.gemm_w4a4(act, ws[i], sc, lora_act_in=la, out=outs[i])

                def quant(i):
                    lib.quantize_act(xs[i], smooth=smooth, lora_down=ld, out_act=q[i][0], out_scales=q[i][1],
                                     out_lora=q[i][2])

                def pair(i):
                    quant(i)
                    gemm(i)

                gemm(0)
                act, sc, la = q[0]
                want = tq.w4a4_unfused(act, sc, p["wgt"], p["wscales"], la, p["lora_up"], p["wcscale"], p["bias"],
                                       tdt, lut=tq.e2m1_lut(tdt, "cuda")).float()
                rel = float((outs[0].float() - want).norm() / want.norm())
                t_g = bench.time_calls(gemm, nset, st)["us"]
                t_q = bench.time_calls(quant, nset, st)["us"]
                t_p = bench.time_calls(pair, nset, st)["us"]
                row[d] = dict(gemm_us=t_g, quant_us=t_q, pair_us=t_p, rel_err=rel)
                print(f"M={m:5d} K={k:5d} N={n:5d} {d:>16s}: gemm {t_g:7.1f}  quant {t_q:6.1f}  pair {t_p:7.1f} "
                      f"(sum {t_g + t_q:7.1f})  cuBLAS {dense:7.1f}  pair x cuBLAS {dense / t_p:5.2f}  "
                      f"gemm x cuBLAS {dense / t_g:5.2f}  err {rel:.1e}", flush=True)
                del ws, q, outs
            rows.append(row)
            del xs
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
