"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter checks what the kernels compute, not whether they compile: tl.dot shapes and dtypes,
constexpr specialisation of arguments equal to 1, shared memory. This compiles every kernel ahead
of time for sm_90 (Triton's own compiler and ptxas, no driver) in a subprocess without
TRITON_INTERPRET, with the bf16 and fp32 launch configurations of `GPU_CONFIGS`, and checks that the bf16
matmuls use Hopper's wgmma, that the H loop is software-pipelined (async copies) and that shared
memory fits an H100/H200 block (227 KiB). The kept-set kernels (kernels/kept_logprobs.py: gathers, no
tl.dot) are compiled too, for the fit only.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from grpo_fast.kernels import kept_logprobs as KK
from grpo_fast.kernels import linear_logprobs as K

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}

def compile_(fn, sig, consts, cfg):
    names = fn.arg_names  # one launch configuration per kernel role (K.KernelConfigs)
    full = {**sig, **{k: "constexpr" for k in consts}}
    # what a launch specialises on 16-byte-aligned pointers and multiples of 16 (real sizes are)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a in ("H", "V") or a.startswith("stride")}
    src = ASTSource(fn=fn, signature={a: full[a] for a in names}, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=cfg.launch_options())
    return {"kernel": fn.__name__, "consts": {a: str(v) for a, v in consts.items()}, "shared": k.metadata.shared,
            "wgmma": k.asm["ptx"].count("wgmma.mma_async"), "async_copy": k.asm["ttgir"].count("async_copy"),
            "tma_store": k.asm["ptx"].count("cp.async.bulk.tensor")}

out = []
for dtype in (torch.bfloat16, torch.float32):  # fp16 shares bf16's code path and tiles
    roles = K.GPU_CONFIGS[dtype]
    t = TYPES[dtype]
    for has_bias, even_k, ones, softcap in [(True, True, False, False), (False, False, True, True)]:
        one = dict(N=1) if ones else {}  # N == 1 becomes a constant at launch
        ints = {a: "i32" for a in ("N", "V", "H") if a not in one}

        def common(cfg):
            return dict(HAS_BIAS=has_bias, SOFTCAP=softcap, EVEN_K=even_k, IEEE=dtype == torch.float32, UPCAST=False,
                        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k)

        for store in (False, True):
            cfg = roles.fused if store else roles.forward
            tma = store and cfg.tma_store  # the logit tiles through a TMA descriptor, else plain stores
            desc = dict(logits_desc=f"tensordesc<{t[1:]}[{cfg.block_n},{cfg.block_v}]>") if tma else {}
            sig = dict(hidden_ptr=t, weight_ptr=t, bias_ptr=t, target_ptr="*i64", stats_ptr="*fp32", logits_ptr=t,
                       **desc, tile_max_ptr="*fp32", **ints, pre="fp32", post="fp32", n_splits="i32", tiles_per_split="i32",
                       stride_h="i32", stride_w="i32", stride_l="i32", stride_m="i32")
            consts = dict(STORE_LOGITS=store, TMA_STORE=tma, **({} if tma else dict(logits_desc=None)), **one, **common(cfg))
            out.append(compile_(K._linear_logprobs_fwd_kernel, sig, consts, cfg))
        for entropy in (False, True):  # the entropy bonus's gradient term (HAS_ENTROPY_GRAD)
            sig = dict(hidden_ptr=t, weight_ptr=t, bias_ptr=t, target_ptr="*i64", lse_ptr="*fp32", g_ptr="*fp32",
                       g_h_ptr="*fp32", h_ptr="*fp32", grad_ptr=t, **ints, pre="fp32", post="fp32", stride_h="i32",
                       stride_w="i32", stride_g="i32")
            out.append(compile_(K._linear_logprobs_bwd_kernel, sig, dict(GROUP=K.GROUP_N, HAS_ENTROPY_GRAD=entropy,
                                                                         **one, **common(roles.backward)),
                                roles.backward))
            sig = dict(logits_ptr=t, tile_max_ptr="*fp32", target_ptr="*i64", lse_ptr="*fp32", g_ptr="*fp32",
                       g_h_ptr="*fp32", h_ptr="*fp32", z_target_ptr="*fp32",
                       **{a: "i32" for a in ("N", "V") if a not in one}, pre="fp32", post="fp32", stride_l="i32",
                       stride_m="i32")
            cfg = roles.fused
            out.append(compile_(K._logits_to_grad_kernel, sig, dict(BLOCK_N=K.to_grad_rows(cfg), BLOCK_V=cfg.block_v,
                                                                    SOFTCAP=softcap, HAS_ENTROPY_GRAD=entropy, **one),
                                K.LaunchConfig(cfg.block_n, cfg.block_v, cfg.block_k, K.TO_GRAD_WARPS, cfg.num_stages)))
    # the kept-set kernels (truncated sampling): gathers, no tl.dot; their launch parameters are KK's
    kept_cfg = K.LaunchConfig(block_n=1, block_v=KK.BLOCK_V, block_k=KK.BLOCK_K, num_warps=KK.NUM_WARPS, num_stages=1)
    for has_bias, softcap, flag in [(True, False, False), (False, True, True)]:
        blocks = dict(BLOCK_V=KK.BLOCK_V, BLOCK_K=KK.BLOCK_K)
        rows = dict(hidden_ptr=t, weight_ptr=t, bias_ptr=t, target_ptr="*i64", ids_ptr="*i64", offsets_ptr="*i64")
        sig = dict(rows, out_ptr="*fp32", z_ptr="*fp32", N="i32", H="i32", pre="fp32", post="fp32", stride_h="i32",
                   stride_w="i32")
        out.append(compile_(KK._kept_fwd_kernel, sig, dict(HAS_BIAS=has_bias, SOFTCAP=softcap, STORE_Z=flag, **blocks),
                            kept_cfg))
        sig = dict(rows, lse_ptr="*fp32", g_ptr="*fp32", g_h_ptr="*fp32", h_ent_ptr="*fp32", z_ptr="*fp32",
                   dr_ptr="*fp32", H="i32", pre="fp32", post="fp32", stride_h="i32", stride_w="i32")
        out.append(compile_(KK._kept_dlogits_kernel, sig, dict(HAS_BIAS=has_bias, SOFTCAP=softcap, STORED=flag,
                                                               HAS_ENTROPY_GRAD=flag, **blocks), kept_cfg))
        sig = dict(hidden_ptr=t, weight_ptr=t, ids_ptr="*i64", offsets_ptr="*i64", dr_ptr="*fp32", grad_hidden_ptr=t,
                   grad_weight_ptr="*fp32", H="i32", stride_h="i32", stride_w="i32", stride_gh="i32")
        out.append(compile_(KK._kept_scatter_kernel, sig, dict(NEED_H=True, NEED_W=has_bias or flag, **blocks),
                            kept_cfg))
    for r in out:
        r.setdefault("dtype", str(dtype))
print(json.dumps(out))
'''


def _nvidia_backend_present() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton without its nvidia backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"compiling for sm_90 failed:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * (2 * 6 + 2 * 3)
    assert {r["consts"].get("HAS_ENTROPY_GRAD") for r in results} == {None, "False", "True"}
    assert {r["consts"].get("SOFTCAP") for r in results} == {None, "False", "True"}  # the model's soft-cap, every
    # kernel that maps logits (the kept scatter reads dr only)
    assert {r["kernel"] for r in results} >= {"_kept_fwd_kernel", "_kept_dlogits_kernel", "_kept_scatter_kernel"}
    for r in results:
        assert r["shared"] <= 227 * 1024, f"{r['kernel']} {r['dtype']}: {r['shared']} bytes of shared memory"
        if r["kernel"] != "_logits_to_grad_kernel" and not r["kernel"].startswith("_kept"):
            assert r["async_copy"] > 0, f"{r['kernel']} {r['dtype']} {r['consts']}: the H loop is not pipelined"
            if r["dtype"] != "torch.float32":
                assert r["wgmma"] > 0, f"{r['kernel']} {r['dtype']} {r['consts']}: no wgmma (Hopper MMA)"
        if r["consts"].get("TMA_STORE") == "True":
            assert r["tma_store"] > 0, f"{r['kernel']} {r['dtype']}: TMA_STORE without a bulk tensor copy"
