"""Builds the prebuilt kernel binaries (flame_core/kernels/binaries/: one fatbin per unit and architecture, and
manifest.json; flame_core/kernels/prebuilt.py says what a unit is and how the loader picks one) with nvcc:

    python tools/build_kernels.py [--archs sm_80,sm_90,sm_100,sm_120,compute_120] [--jobs 2] [--nvcc PATH] [stem ...]
    python tools/build_kernels.py --check        # exit 1 when a binary is stale or missing (no nvcc needed)

Each unit gets exactly what NVRTC gets at run time: the loader's expanded source (local headers inlined with #line
directives), the loader's NVRTC_OPTIONS and CuPy's -ftz=true. Template kernels are instantiated by taking their
address in a host function appended to the source (what NVRTC's name expressions do), and the lowered names are
read from the PTX nvcc keeps (`.entry` lines) and matched to the expressions through c++filt. The files whose
source has a `// arch: sm_90a` line are built for sm_90a only (when sm_90 is asked for). A unit whose key, name
expressions and file already match the manifest is not rebuilt. The output does not depend on the machine: nvcc
writes the same bytes for the same source and options (the check compares the recorded sha256 of every file).
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flame_core.kernels import loader as L  # noqa: E402
from flame_core.kernels import prebuilt as PB  # noqa: E402
from flame_core.kernels import precompile  # noqa: E402

# sm_80 code also runs on sm_86 / sm_89, sm_120's on sm_121; compute_120 PTX: newer GPUs (the driver compiles it)
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120", "compute_120")
DTYPES = ("float32", "float16", "bfloat16")
_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)\s*\(", re.M)

def _extra_expressions():
    """{stem: [(expression with {T}, dtypes, lowest sm)]}: the multi-parameter template instantiations the kernel
    families ask for with their default settings (their tables and module-level knobs), compiled into the unit of
    their dtype beside its single-parameter templates for every arch from `lowest sm` on (clusters, TMA and bulk
    copies need sm_90). Other settings (benchmark sweeps, environment overrides) compile through NVRTC as before."""
    from flame_core.kernels import activations as A
    from flame_core.kernels import attention as AT
    from flame_core.kernels import conv as C
    from flame_core.kernels import groupnorm as G
    from flame_core.kernels import norms as N
    from flame_core.kernels import plans as P
    half, every = ("float16", "bfloat16"), DTYPES
    ex = {}

    def add(stem, expr, dtypes=every, sm=0):
        if (expr, dtypes, sm) not in ex.setdefault(stem, []):
            ex[stem].append((expr, dtypes, sm))

    # single-parameter templates declared through a macro (the loader's scan does not see them): one each
    for name in re.findall(r"^FLAME_POINTWISE_GRAD\((\w+)\s*,", L._read(L.CUDA_SRC / "pointwise_grad.cu"), re.M):
        add("pointwise_grad", f"{name}<{{T}}>")
    for (name, _), (u, _) in sorted(A._PLANS.items()):
        add("activations", f"{name}<{{T}}, {u}>")
    for (name, _), (u, _) in sorted(A._STEP_PLANS.items()):
        add("activations", f"{name}_step<{{T}}, {u}>", half)
    for (name, _), (chunk, _) in sorted(A._BULK_PLANS.items()):
        add("activations", f"{name}_bulk<{{T}}, {chunk}>", half, 90)
    add("activations", "silu_fwd<{T}, 1>")

    for kind in (0, 1, 2, AT.MASK_KEYPAD):  # no mask, boolean mask, additive mask, key padding (Hopper only)
        for D, tiles in sorted(AT.FWD_TILES.items()) if kind != AT.MASK_KEYPAD else ():
            for t in sorted({tiles["mask"]} if kind else {tiles["large"], tiles["small"]}):
                add("flash_attention_fwd", "flash_attn_fwd<{T}, %d, %d, %d, %d, %d, %d>" % ((D,) + t[:3] + (kind,)
                                                                                          + t[3:]), half)
        for D, (BM, BN, NW, WMS, WNKV, WMQ, OPT) in sorted(AT.BWD_TILES.items()) if kind != AT.MASK_KEYPAD else ():
            add("flash_attention_bwd", f"flash_attn_bwd<{{T}}, {D}, {BM}, {BN}, {NW}, {WMS}, {WNKV}, {WMQ}, {kind}, "
                                       f"{OPT}>", half)
        ov = int(AT.SM90_FWD_OVERLAP)  # the launch's schedule
        for D, (BN, NWG, ST) in sorted(AT.FWD_SM90_TILES.items()):
            for pp in (0, 1) if NWG == 2 else (0,):  # the ping-pong switch (SM90_FWD_PINGPONG) either way
                for tma in (True, False):  # K / V by TMA, and by cp.async where TMA cannot describe the strides
                    add("flash_attention_fwd_sm90", AT.sm90_fwd_expression(D, BN, NWG, ST, kind, pp, tma, ov), half,
                        90)
        for D, (NWG, ST, BM) in sorted(AT.BWD_SM90_TILES.items()):
            dqbs = {0} | ({1} if AT.SM90_BWD_BULK_DQ and (D if BM == 128 else D // NWG) == 64 else set())
            for dqb in sorted(dqbs):
                st = ST
                while dqb and st > 2 and AT._bwd_sm90_smem(D, NWG, st, BM, dqb) > AT.SM90_SMEM_MAX:
                    st -= 1
                for tma in (True, False):  # Q / dO by TMA, and by cp.async where TMA cannot describe the strides
                    add("flash_attention_bwd_sm90", AT.sm90_bwd_expression(D, NWG, st, kind, BM, dqb, tma), half, 90)

    for name, (bm, bn, wm, wn, st, minb, pipe, serves) in sorted(C.TILES.items()):
        for kern, role in (("conv_fwd_igemm", C.FWD), ("conv_dw_igemm", C.DW)):
            if role in serves:
                add("conv_igemm", f"{kern}<{{T}}, {bm}, {bn}, {wm}, {wn}, {st}, {minb}, {pipe}>", half)
    for name, (bn, st) in sorted(C.WGMMA_TILES.items()):
        for epi in (C.EPI_PLAIN, C.EPI_ADDS, C.EPI_PHASED):
            for flag in (", 1", ", 2", ", 1, true"):
                add("conv_wgmma", f"conv_fwd_wgmma<{{T}}, {bn}, {st}, {epi}{flag}>", half, 90)
        for flag in (", 1", ", 2", ", 1, true"):
            add("conv_wgmma", f"conv_dw_wgmma<{{T}}, {bn}, {st}{flag}>", half, 90)

    for act in (0, 1):  # no activation, SiLU
        add("groupnorm", f"gn_fwd_cluster<{{T}}, 8, {G.gn_one_pass}, {act}>", every, 90)
        add("groupnorm", f"gn_bwd_cluster<{{T}}, 8, {act}>", every, 90)
        for v in G.GN_REG_V:
            if v <= G.GN_REG_FWD_MAX_V:
                add("groupnorm", f"gn_fwd_cluster_reg<{{T}}, {v}, {act}>", every, 90)
            add("groupnorm", f"gn_bwd_cluster_reg<{{T}}, {v}, {act}>", every, 90)

    for acc in (1, 2):  # dw; dw and db
        for vpt in (1, 2):
            if N.bwd_cluster:
                add("norms", f"norm_bwd_cl<{{T}}, {vpt}, {acc}, {N.bwd_cluster}, {N.bwd_cluster_smem}, "
                             f"{N.bwd_cluster_regs}>", every, 90)
            for d in every:
                loop = N._tma_loop(P.vec_width(P.np.dtype(d) if d != "bfloat16" else _bf16()), vpt, acc,
                                   N.bwd_tma_regs)
                add("norms", f"norm_bwd_tma<{{T}}, {vpt}, {acc}, {N.bwd_tma_regs}, {loop}>", (d,), 90)
    return ex


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


EXTRA_EXPRESSIONS = _extra_expressions()


def options():
    return tuple(L.NVRTC_OPTIONS) + PB.EXTRA_OPTIONS


def units(stems=None):
    """[(stem, dtype name or None, [(name expression, lowest sm)])] of every unit the loader can ask for."""
    out = []
    for p in sorted(L.CUDA_SRC.glob("*.cu")):
        stem = p.stem
        if stems and stem not in stems:
            continue
        names = L.template_kernels(stem)
        extra = EXTRA_EXPRESSIONS.get(stem, ())
        if not names and not extra:
            out.append((stem, None, []))
            continue
        for d in precompile._file_dtypes(stem, DTYPES):
            t = L._CTYPES[d]
            exprs = [(f"{n}<{t}>", 0) for n in names] + [(e.replace("{T}", t), sm) for e, ds, sm in extra if d in ds]
            if exprs:  # (a dtype no kernel of the file is asked for, e.g. float32 attention: no unit)
                out.append((stem, d, exprs))
    return out


def arch_exprs(exprs, arch):
    """The expressions of a unit compiled for `arch` (those whose lowest sm it reaches)."""
    num = int(arch.split("_")[1].rstrip("a"))
    return [e for e, sm in exprs if num >= sm]


def unit_archs(stem, archs):
    exact = L.file_arch(stem)
    if exact is not None:  # (no PTX for these: compute_90a code runs on 9.0 only, as the cubin does)
        return [exact] if f"sm_{exact[3:].rstrip('a')}" in archs else []
    return list(archs)


def instantiation_source(stem, exprs):
    text = L.source(stem)
    if not exprs:
        return text
    refs = "".join(f"  (void)&{e};\n" for e in exprs)
    return (f"{text}\n// tools/build_kernels.py: the instantiations NVRTC's name expressions make\n"
            f"static void __flame_prebuilt_instantiate() {{\n{refs}}}\n")


def _template_args(s):
    """'name<a, b>...' -> ('name', ['a', 'b']) with each argument normalised ('true' -> '1', '(int)3' -> '3',
    '3u' -> '3', no spaces)."""
    s = s.strip()
    if s.startswith("void "):
        s = s[5:]
    lt = s.find("<")
    if lt < 0:
        return s.split("(")[0].strip(), ()
    name, depth, args, cur = s[:lt].strip(), 0, [], ""
    for ch in s[lt:]:
        if ch == "<":
            depth += 1
            if depth == 1:
                continue
        elif ch == ">":
            depth -= 1
            if depth == 0:
                args.append(cur)
                break
        elif ch == "," and depth == 1:
            args.append(cur)
            cur = ""
            continue
        cur += ch

    def norm(a):
        a = re.sub(r"^\([\w\s:]+\)", "", a.strip()).replace(" ", "")
        a = {"true": "1", "false": "0"}.get(a, a)
        return re.sub(r"^(-?\d+)[uUlL]+$", r"\1", a)
    return name, tuple(norm(a) for a in args)


def lowered_names(entries, exprs):
    """{expression: mangled entry} for the template expressions, and the extern "C" entries."""
    mangled = [e for e in entries if e.startswith("_Z")]
    c_names = sorted(e for e in entries if not e.startswith("_Z"))
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True,
                               check=True).stdout.splitlines() if mangled else []
    by_sig = {}
    for m, d in zip(mangled, demangled):
        by_sig.setdefault(_template_args(d), []).append(m)
    names, exact = {}, {_template_args(e) for e in exprs}
    for e in exprs:
        name, args = _template_args(e)
        hit = by_sig.get((name, args), [])
        if not hit:  # defaulted template arguments (`bool TMA = false`): the kernel whose arguments extend these,
            # unless another expression names that one
            hit = [m for (n, a), ms in by_sig.items() for m in ms
                   if n == name and len(a) > len(args) and a[:len(args)] == args and (n, a) not in exact]
        if len(hit) != 1:
            raise RuntimeError(f"name expression {e!r}: {len(hit)} matching kernels in the compiled module")
        names[e] = hit[0]
    return names, c_names


def _gencode(arch):
    """sm_XY: machine code; compute_XY: PTX only (the forward fallback for newer GPUs)."""
    num = arch.split("_")[1]
    return f"arch=compute_{num},code={arch}"


def compile_unit(nvcc, stem, dtype, exprs, arch, out_path):
    """Compile one unit for one arch into out_path (written whole: temp, fsync, rename); returns (names, c_names)."""
    with tempfile.TemporaryDirectory(prefix="flame-build-") as tmp:
        cu = Path(tmp) / f"{stem}.{dtype or 'none'}.cu"
        cu.write_text(instantiation_source(stem, exprs))
        keep = Path(tmp) / "keep"
        keep.mkdir()
        fat = Path(tmp) / "out.fatbin"
        cmd = [nvcc, *options(), "-fatbin", f"-gencode={_gencode(arch)}", "--compress-mode=size", "-keep",
               "-keep-dir", str(keep), "-o", str(fat), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {stem} ({dtype}, {arch}):\n{r.stdout}{r.stderr}")
        entries = sorted({e for p in keep.glob("*.ptx") for e in _ENTRY.findall(p.read_text())})
        names, c_names = lowered_names(entries, exprs)
        data = fat.read_bytes()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out_path.with_suffix(".tmp")
    with open(tmp_out, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_out, out_path)
    return names, c_names


def sha256_file(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest():
    try:
        m = json.loads(PB.MANIFEST.read_text())
        if m.get("format") == PB.FORMAT:
            return m
    except (OSError, ValueError):
        pass
    return {"format": PB.FORMAT, "units": {}}


def write_manifest(m):
    PB.DIR.mkdir(parents=True, exist_ok=True)
    tmp = PB.MANIFEST.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(m, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, PB.MANIFEST)


def check(m=None):
    """Problems of the shipped binaries against the sources: [str] (empty when every unit is current)."""
    m = m or read_manifest()
    problems, want = [], {PB.unit_name(s, d): (s, d, e) for s, d, e in units()}
    for name, (stem, dtype, exprs) in want.items():
        u = m["units"].get(name)
        if u is None:
            problems.append(f"{name}: not built")
            continue
        if u["key"] != PB.key(L.source(stem), options()):
            problems.append(f"{name}: stale (cuda_src changed since the build)")
        if u["expressions"] != [list(e) for e in exprs]:
            problems.append(f"{name}: its name expressions changed")
        for arch, f in u["files"].items():
            p = PB.DIR / f["path"]
            if not p.is_file() or sha256_file(p) != f["sha256"]:
                problems.append(f"{name}: {f['path']} missing or not the file built")
    problems += [f"{name}: no such unit in cuda_src" for name in m["units"] if name not in want]
    return problems


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    v = re.search(r"release [\d.]+, V([\d.]+)", out)
    return v.group(1) if v else out.strip().splitlines()[-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stems", nargs="*", help="only these cuda_src files (default: all)")
    ap.add_argument("--archs", default=",".join(DEFAULT_ARCHS), help="comma-separated sm_XY list")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--nvcc", default=os.environ.get("NVCC") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--check", action="store_true", help="only check the shipped binaries against the sources")
    a = ap.parse_args(argv)
    if a.check:
        problems = check()
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s); rebuild with: python tools/build_kernels.py" if problems else "ok")
        return 1 if problems else 0
    archs = [s.strip() for s in a.archs.split(",") if s.strip()]
    bad = [s for s in archs if not re.fullmatch(r"(sm|compute)_\d+", s)]
    if bad:
        print(f"build_kernels: --archs: {bad} are not sm_XY / compute_XY names", file=sys.stderr)
        return 2
    if not Path(a.nvcc).is_file():
        print(f"build_kernels: nvcc not found at {a.nvcc} (--nvcc or $NVCC)", file=sys.stderr)
        return 2
    m = read_manifest()
    m["nvcc"], m["options"] = nvcc_version(a.nvcc), list(options())
    all_units = units()
    names_now = {PB.unit_name(s, d) for s, d, _ in all_units}
    for name in [n for n in m["units"] if n not in names_now]:  # a removed cuda_src file
        for f in m["units"].pop(name)["files"].values():
            (PB.DIR / f["path"]).unlink(missing_ok=True)
    jobs = []
    for stem, dtype, exprs in units(set(a.stems) or None):
        name = PB.unit_name(stem, dtype)
        k = PB.key(L.source(stem), options())
        u = m["units"].get(name)
        if u is None or u["key"] != k or u["expressions"] != [list(e) for e in exprs]:
            for f in (u or {}).get("files", {}).values():
                (PB.DIR / f["path"]).unlink(missing_ok=True)
            u = m["units"][name] = {"stem": stem, "dtype": dtype, "key": k, "expressions": [list(e) for e in exprs],
                                    "files": {}}
        for arch in unit_archs(stem, archs):
            f = u["files"].get(arch)
            if (f and "names" in f and (PB.DIR / f["path"]).is_file()
                    and sha256_file(PB.DIR / f["path"]) == f["sha256"]):
                continue
            jobs.append((name, stem, dtype, arch_exprs(exprs, arch), arch))
    print(f"{len(jobs)} compiles ({len(all_units)} units, archs {archs}, nvcc {m['nvcc']})", flush=True)

    def run(job):
        name, stem, dtype, exprs, arch = job
        rel = f"{arch}/{stem}.{dtype or 'none'}.fatbin"
        t = time.perf_counter()
        names, c_names = compile_unit(a.nvcc, stem, dtype, exprs, arch, PB.DIR / rel)
        return job, rel, names, c_names, time.perf_counter() - t

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for fut in concurrent.futures.as_completed([pool.submit(run, j) for j in jobs]):
            try:
                (name, stem, dtype, exprs, arch), rel, names, c_names, sec = fut.result()
            except RuntimeError as e:
                failed += 1
                print(str(e), file=sys.stderr, flush=True)
                continue
            m["units"][name]["files"][arch] = {"path": rel, "sha256": sha256_file(PB.DIR / rel), "names": names,
                                               "c_names": c_names}
            write_manifest(m)  # after every unit: an interrupted build keeps what it finished
            print(f"{name:28s} {arch:7s} {sec:6.1f} s  {(PB.DIR / rel).stat().st_size / 1024:7.0f} KiB", flush=True)
    write_manifest(m)
    total = sum((PB.DIR / f["path"]).stat().st_size for u in m["units"].values() for f in u["files"].values())
    print(f"{'FAILED: ' + str(failed) + ' compiles; ' if failed else ''}prebuilt binaries: {total / 2**20:.1f} MiB",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
