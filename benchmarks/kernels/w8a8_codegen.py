"""The sm_90 PTX Triton generates for the W8A8 GEMM and the masked W8A8 MoE at every tile config they pick, and for
the weight-only GEMM and MoE, on a machine without a GPU: dump it before and after a change to the kernels and compare
the K loops, so that a change meant to be codegen-neutral is checked as such where no GPU can time it.

    python benchmarks/kernels/w8a8_codegen.py dump > after.txt     # and, on the old commit, > before.txt
    python benchmarks/kernels/w8a8_codegen.py compare before.txt after.txt
"""

import collections
import difflib
import re
import sys


def dump() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_mxfp8.ops import triton_sm90 as th

    def compile_sm90(kernel, pointers, constexprs, config):
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=config)

    def options(cfg):
        return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}

    kernels = []
    moe = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "padded_ptr": "*i32", "topk_w_ptr": "*fp32",
           "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16", "a_ptr": "*fp8e4nv", "sa_ptr": "*fp32"}
    for m in (4, 4096):  # both tile configs of a 128-expert top-8 layer
        cfg = th.moe_w8a8_config(m, 8, 128)
        tiles = {k: v for k, v in cfg.items() if k.startswith("BLOCK")}
        for up in (True, False):
            gemm = dict(A_ROW_DIV=8, MUL_ROUTED_WEIGHT=False) if up else dict(A_ROW_DIV=1, MUL_ROUTED_WEIGHT=True)
            kernels.append((f"moe BLOCK_M={tiles['BLOCK_M']} {'up' if up else 'down'}", compile_sm90(
                th._moe_w8a8_kernel, moe, {**gemm, **tiles, "BLOCK_K": th.GROUP_K}, options(cfg))))
    dense = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
             "bias_ptr": "*bf16"}
    for m in (8, 100, 4096):  # the three tile configs of _config
        cfg = th._config(m)
        for bias in (False, True):
            kernels.append((f"dense m={m} bias={bias}", compile_sm90(
                th._w8a8_gemm_kernel, dense, {"HAS_BIAS": bias, **{k: v for k, v in cfg.items() if k.isupper()}},
                options(cfg))))
    for m in (1, 64):  # the weight-only GEMM and MoE, which share the tile loads
        cfg = th.w8a16_config(m)
        kernels.append((f"weight-only dense m={m}", compile_sm90(
            th._w8a16_gemm_kernel, {**dense, "x_ptr": "*bf16"},
            {"SCALE_ROWS": 1, "HAS_BIAS": True, **{k: v for k, v in cfg.items() if k.isupper()}, "BLOCK_K": th.GROUP_K},
            options(cfg))))
    cfg = th.MOE_W8A16_CONFIG
    kernels.append(("weight-only MoE down", compile_sm90(
        th._moe_w8a16_kernel, {**moe, "a_ptr": "*bf16"},
        {"A_ROW_DIV": 1, "MUL_ROUTED_WEIGHT": True, **{k: v for k, v in cfg.items() if k.isupper()},
         "BLOCK_K": th.GROUP_K}, options(cfg))))
    for name, compiled in kernels:
        print(f"===== {name}")
        ptx = compiled.asm["ptx"]
        ptx = ptx[:ptx.find(".section\t.debug")] if ".section\t.debug" in ptx else ptx
        print("\n".join(line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//"))))


def _kernels(path):
    out, name = {}, None
    for line in open(path):
        if line.startswith("===== "):
            name = line[6:].strip()
            out[name] = []
        elif not line.startswith("$L__tmp"):  # inlining's debug labels
            out[name].append(re.sub(r"%(r|rd|f|p|rs|hs|b)\d+", r"%\1", line))  # register numbers
    return out


def _loop(lines):
    """The K loop: from LLVM's inner-loop header to the branch back to it."""
    head = next(i for i, x in enumerate(lines) if "Inner Loop Header" in x)
    label = lines[head].split(":")[0]
    end = next(j for j in range(head, len(lines)) if "bra" in lines[j] and lines[j].rstrip().endswith(f"{label};"))
    return lines[head:end + 1]


def compare(before: str, after: str) -> int:
    old, new = _kernels(before), _kernels(after)
    same = True
    for name in old:
        ops = [collections.Counter(x.split()[0] for x in k[name] if x.startswith("\t") and x.strip()[:1].isalpha())
               for k in (old, new)]
        loop_same = _loop(old[name]) == _loop(new[name])
        same &= loop_same and ops[0] == ops[1]
        moved = sum(line[:1] in "+-" and line[:3] not in ("+++", "---")
                    for line in difflib.unified_diff(old[name], new[name], n=0))
        print(f"{name}: K loop {'identical' if loop_same else 'DIFFERS'} ({len(_loop(old[name]))} lines), "
              f"instruction counts {'equal' if ops[0] == ops[1] else 'DIFFER'}, {moved} lines differ")
    return 0 if same else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        dump()
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
