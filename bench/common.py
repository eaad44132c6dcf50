"""What the benchmarks share: timing on CUDA events, results (printed as they come, written to $OUT/<bench>.json with
the device, commit and date of the run), tables, the peers (PyTorch / diffusers, when importable) and Flux-dev inputs.

A bench script runs as `PYTHONPATH=$PWD python3 bench/<name>.py` (bench/ is then on sys.path: `import common`).
The typical shape of one:

    res = common.Results("mybench")
    common.run_parts(res, [("FLAME", lambda: flame_part(res)), ("torch", lambda: torch_part(res))])
    print(common.table(["op", "FLAME ms", "torch ms", "ratio"], rows, title="..."))
"""
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from importlib import metadata

T5_LEN = 512  # the peer setup's T5 length (Flux-dev's)


# ----------------------------------------------------------------------------- results
def context():
    """Where and when a run happened: device, driver, commit (with '+dirty' for uncommitted changes), date, versions."""
    ctx = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "argv": sys.argv}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        ctx["commit"] = commit + ("+dirty" if dirty else "") if commit else None
    except (OSError, subprocess.SubprocessError):
        ctx["commit"] = None
    if os.environ.get("FLAME_COMMIT"):  # a copied tree whose .git is not the source's (the lent GPU): the sender's
        ctx["commit"] = os.environ["FLAME_COMMIT"]
    for pkg in ("numpy", "cupy", "cupy-cuda13x", "cupy-cuda12x", "torch", "diffusers", "peft"):
        try:
            ctx[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:  # whether the C extension's per-op hooks ran (flame_core._speedups; FLAME_SPEEDUPS=0 turns them off)
        from flame_core.memory import recycle
        ctx["speedups"] = recycle._c is not None
    except ImportError:
        pass
    try:
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        ctx["device"] = name.decode() if isinstance(name, bytes) else name
        ctx["driver"] = cp.cuda.runtime.driverGetVersion()
    except Exception:  # no GPU: a cpu run
        ctx["device"] = "cpu"
    return ctx


class Results(dict):
    """A bench's figures by key: each printed as it comes; `save()` writes them with the run's context to
    $OUT/<name>.json (without $OUT: ./out/<name>.json, a git-ignored folder, not the working tree's root)."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.path = os.path.join(os.environ.get("OUT") or "out", f"{name}.json")

    def log(self, key, value):
        self[key] = value
        print(f"{key}: {value}", flush=True)
        return value

    def save(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"bench": self.name, "context": context(), "results": dict(self)}, f, indent=1, default=str)
        return self.path


def section(name):
    print(f"\n== {name} ({time.strftime('%X')})", flush=True)


def run_parts(res, parts):
    """Run each (name, fn) in turn; a part that raises is reported (traceback) and the others still run. The
    results are saved after every part. Returns True when a part failed."""
    failed = False
    for name, fn in parts:
        section(name)
        try:
            fn()
        except Exception:
            traceback.print_exc()
            failed = True
        res.save()
    return failed


# ----------------------------------------------------------------------------- formatting
def gib(nbytes, digits=2):
    return None if nbytes is None else round(nbytes / 2 ** 30, digits)


def ratio(a, b, digits=3):
    """a / b rounded, or '-' when either is missing or not a number."""
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(a / b, digits) if ok else "-"


def table(header, rows, title=None):
    """A plain-text table: columns as wide as their widest cell, numbers right-aligned."""
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
    lines = [title] if title else []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and _numeric(c) else c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(s):
    try:
        float(s.split(" ")[0])
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------- timing
def _events(lib):
    """(record start, record end and wait, elapsed ms) for CUDA events of `lib` ('cupy' or 'torch')."""
    if lib == "torch":
        import torch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return a.record, lambda: (b.record(), b.synchronize()), lambda: a.elapsed_time(b)
    import cupy as cp
    a, b = cp.cuda.Event(), cp.cuda.Event()
    return a.record, lambda: (b.record(), b.synchronize()), lambda: cp.cuda.get_elapsed_time(a, b)


def synchronize(lib="cupy"):
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
    else:
        import cupy as cp
        cp.cuda.Device().synchronize()


def cuda_ms(fn, repeats=5, warmup=2, lib="cupy", before=None, inner=1):
    """(median ms per fn() call between CUDA events, median host ms of issuing the calls, every sample) after
    `warmup` calls. `inner` calls run back to back in each interval (the figure is per call); `before()` is queued
    ahead of each interval (`busy_gpu`: the GPU is still busy while the host issues the calls, so the interval holds
    the GPU's work alone, not the host's launch time)."""
    for _ in range(warmup):
        fn()
    synchronize(lib)
    ms, host = [], []
    for _ in range(repeats):
        start, stop, elapsed = _events(lib)
        if before is not None:
            before()
        start()
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - t) * 1e3 / inner)
        stop()
        ms.append(elapsed() / inner)
    return statistics.median(ms), statistics.median(host), ms


def host_ms(fn, repeats):
    """(median ms, every sample) of `repeats` fn() calls by the wall clock: a cpu run's step time."""
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms), ms


# ----------------------------------------------------------------------------- runs in processes of their own
def run_child(script, spec, timeout, title):
    """Run one spec of bench `script` in a fresh process (`script --child <spec JSON> --child-out <file>`: its peaks
    are its own); returns the result dict the child wrote (end_child), or one with 'error' set when it wrote none."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run.json")
        cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(spec), "--child-out", out]
        section(title)
        try:
            rc = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {"spec": spec, "results": {}, "error": f"run ended without results (exit {rc})"}


def end_child(out_path, spec, res, err, t0):
    """A child's last act: {spec, results, error, host_peak_rss_GiB (pinned buffers count), wall_s} written whole to
    `out_path` (temp file and rename), then os._exit(0) -- no interpreter teardown (CuPy's exit hooks printed errors
    from it)."""
    import resource
    out = {"spec": spec, "results": dict(res), "error": err,
           "host_peak_rss_GiB": gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 2),
           "wall_s": round(time.perf_counter() - t0, 1)}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(out, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def error_line(e):
    """An exception as one line: its type and its message's first line (a run's row says why it failed)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# ----------------------------------------------------------------------------- GPU clocks during a measurement
# nvidia-smi's clocks_event_reasons bits (NVML's clocksEventReasons): what held the SM clock down
CLOCK_EVENTS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
                0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}
SLOWDOWN_EVENTS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
_SMI_FIELDS = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def parse_clock_samples(lines):
    """nvidia-smi CSV lines (noheader, nounits) of _SMI_FIELDS -> a summary dict: SM clock min / median / rated max
    (MHz), peak power (W) and temperature (C), the clock events seen (names), how many samples; None without any."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            sm, smax, power, temp = int(float(parts[0])), int(float(parts[1])), float(parts[2]), float(parts[3])
            events = int(parts[4], 16)
        except ValueError:
            continue
        rows.append((sm, smax, power, temp, events))
    if not rows:
        return None
    mask = 0
    for r in rows:
        mask |= r[4]
    sms = sorted(r[0] for r in rows)
    return {"sm_mhz_min": sms[0], "sm_mhz_median": sms[len(sms) // 2], "sm_mhz_rated": max(r[1] for r in rows),
            "power_w_max": max(r[2] for r in rows), "temp_c_max": max(r[3] for r in rows),
            "clock_events": [name for bit, name in CLOCK_EVENTS.items() if mask & bit], "samples": len(rows)}


def slowed(summary):
    """The clock events in `summary` that lower the SM clock (power or thermal caps, hardware slowdown); [] if none."""
    return [] if not summary else [e for e in summary.get("clock_events") or () if e in SLOWDOWN_EVENTS]


class GpuClocks:
    """The GPU's SM clock, power, temperature and clock-event reasons sampled by `nvidia-smi -lms` while the block
    runs: a step timed while the clock was capped (power, thermal) is not comparable with one that was not.
    `.summary` after the block (parse_clock_samples); None where nvidia-smi is missing or printed nothing.

        with common.GpuClocks() as clk:
            ms, _, _ = common.cuda_ms(step, 5)
        res.log("step_clocks", clk.summary)
    """

    def __init__(self, interval_ms=100, device=0):
        self.interval_ms, self.device, self.summary, self._proc = int(interval_ms), device, None, None

    def _target(self):
        try:
            import cupy
            return cupy.cuda.Device(self.device).pci_bus_id  # the physical GPU whatever CUDA_VISIBLE_DEVICES says
        except Exception:
            return str(self.device)

    def __enter__(self):
        target, fields = self._target(), _SMI_FIELDS
        try:
            # drivers before R530 name the reasons clocks_throttle_reasons: ask once which name this one knows
            probe = subprocess.run(["nvidia-smi", "-i", target, f"--query-gpu={fields}", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=10)
            if probe.returncode != 0:
                fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
            self._proc = subprocess.Popen(["nvidia-smi", "-i", target, f"--query-gpu={fields}",
                                           "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, subprocess.TimeoutExpired):
            self._proc = None
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.summary = parse_clock_samples((out or "").splitlines())


_BUSY = {}


def busy_gpu(lib="cupy", nbytes=1 << 30):
    """A function that queues a memset of `nbytes` (1 GiB: ~0.35 ms on an H100) on the current stream."""
    if lib == "torch":
        import torch
        if "torch" not in _BUSY:   # (a tensor's truth value is not its existence)
            _BUSY["torch"] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        buf = _BUSY["torch"]
        return lambda: buf.fill_(1)
    import cupy as cp
    if "cupy" not in _BUSY:
        _BUSY["cupy"] = cp.empty(nbytes, dtype=cp.uint8)
    buf = _BUSY["cupy"]
    return lambda: cp.cuda.runtime.memsetAsync(buf.data.ptr, 1, buf.nbytes, cp.cuda.get_current_stream().ptr)


def host_us(fn, lib="cupy", n=200):
    """Host microseconds per fn() call: n calls issued without waiting (the GPU runs behind)."""
    fn()
    synchronize(lib)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    synchronize(lib)
    return dt / n * 1e6


# ----------------------------------------------------------------------------- peers
def import_torch():
    """torch, or None where it is not importable (the peers are never a dependency of the library)."""
    try:
        import torch
        return torch
    except ImportError:
        return None


def diffusers_flux(blocks=None):
    """diffusers' FluxTransformer2DModel at Flux-dev's size (or `blocks` = (double, single) blocks), random init,
    bf16 on the GPU, frozen; torch's cuDNN SDPA backend off (it fails in backward on the device image)."""
    import torch
    from diffusers import FluxTransformer2DModel
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    nd, ns = blocks or (19, 38)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=nd, num_single_layers=ns,
                                           attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                           pooled_projection_dim=768, guidance_embeds=True,
                                           axes_dims_rope=(16, 56, 56))
    finally:
        torch.set_default_dtype(torch.float32)
    return model.requires_grad_(False)


def diffusers_inputs(size, guidance):
    """The diffusers model's keyword arguments for a batch of 1 at size x size (random latents and text states)."""
    import torch
    tokens, side = (size // 16) ** 2, size // 16
    img_ids = torch.zeros(side, side, 3, device="cuda")
    img_ids[..., 1] = torch.arange(side, device="cuda")[:, None]
    img_ids[..., 2] = torch.arange(side, device="cuda")[None, :]
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(1, tokens, 64, **bf16), encoder_hidden_states=torch.randn(1, T5_LEN, 4096,
                **bf16), pooled_projections=torch.randn(1, 768, **bf16), timestep=torch.full((1,), 0.62, **bf16),
                img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(T5_LEN, 3, device="cuda"),
                guidance=torch.full((1,), guidance, **bf16), return_dict=False)


# ----------------------------------------------------------------------------- FLAME's Flux-dev
def random_flux(params="flux-dev", device="cuda", seed=0, std=0.02, chunk=1 << 26):
    """A random-init Flux (N(0, std) bf16 weights, QK-norm scales 1) filled without fragmenting FLAME's pool
    (lora_step.random_init_, drawing `chunk` values at a time)."""
    import lora_step

    import flame_core as flame
    import flame_nn
    from flame_models.flux import Flux
    from flame_models.flux.params import flux_params
    with flame_nn.empty_init(device=device, dtype=flame.bfloat16):
        model = Flux(flux_params(params))
    return lora_step.random_init_(model, seed=seed, std=std, device=device, chunk=chunk)


def flame_flux_inputs(size, guidance, seed=1, device="cuda"):
    """Flux's keyword arguments for a batch of 1 at size x size (random bf16 latents and text states) and a random
    float32 target of the output's shape, on `device` (a rank's own GPU under a launcher)."""
    import flame_core as flame
    from flame_models.flux import sampling as S
    g = flame.Generator(device).manual_seed(seed)
    tokens = (size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device=device).to(flame.bfloat16)
    bf16 = dict(dtype=flame.bfloat16, device=device)
    args = dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(size, size, device=device), txt=rnd(1, T5_LEN, 4096),
                txt_ids=S.text_ids(T5_LEN, device=device), y=rnd(1, 768),
                timesteps=flame.tensor([0.62], **bf16), guidance=flame.tensor([guidance], **bf16))
    return args, flame.randn(1, tokens, 64, generator=g, device=device)


def flame_flux_loss_step(model, kw):
    """fwd_bwd(img, txt, y, target) -> the detached loss: one training step's forward under bf16 autocast with the
    Flux keyword arguments `kw` (flame_flux_inputs) but these tensors, the float32 mean squared error, and backward.
    Its tensor arguments are what flame.cuda.graphed replays."""
    import flame_core as flame
    from flame_core import amp

    def fwd_bwd(img, txt, y, target):
        with amp.autocast("cuda", dtype=flame.bfloat16):
            pred = model(**dict(kw, img=img, txt=txt, y=y))
        loss = ((pred.float() - target) ** 2).mean()
        loss.backward()
        return loss.detach()
    return fwd_bwd
