"""Small models for the streaming tests: an MLP block stack, and a tiny Flux with LoRA on its attention."""
import numpy as np

import flame_core as flame
import flame_nn as nn
from flame_nn import adapters as A
from flame_nn.offload import run_block


class Block(nn.Module):
    """x + W2 relu(W1 x) * gain: two Linears and one extra trainable-or-frozen vector."""

    def __init__(self, d, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, device=device, dtype=dtype)
        self.fc2 = nn.Linear(2 * d, d, device=device, dtype=dtype)
        self.gain = nn.Parameter(flame.ones(d, device=device, dtype=dtype or flame.float32))

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu()) * self.gain


class Stack(nn.Module):
    gradient_checkpointing = False

    def __init__(self, d=16, n=5, device=None, dtype=None):
        super().__init__()
        self.inp = nn.Linear(d, d, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d, device, dtype) for _ in range(n))
        self.out = nn.Linear(d, d, device=device, dtype=dtype)

    def forward(self, x):
        x = self.inp(x)
        for i in range(len(self.blocks)):
            x = run_block(self.blocks, i, x)
        return self.out(x)


def stack_pair(d=16, n=5, device=None, dtype=None, seed=0):
    """Two Stacks with the same weights."""
    flame.manual_seed(seed)
    a = Stack(d, n, device, dtype)
    b = Stack(d, n, device, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def tiny_flux(device=None, dtype=flame.float32, seed=0, lora=True):
    from flame_models.flux import Flux
    from flame_models.flux.lora_keys import TARGET_PRESETS, name_map_for
    flame.manual_seed(seed)
    model = Flux("flux-tiny", dtype=dtype, device=device)
    rng = np.random.default_rng(seed)
    with flame.no_grad():  # larger than the default init, so every block matters to the output
        for name, p in model.named_parameters():
            if not name.endswith(".scale"):
                p.copy_(flame.tensor(0.2 * rng.standard_normal(tuple(p.shape)), dtype=p.dtype, device=p.device))
    if lora:
        A.inject_adapters(model, TARGET_PRESETS["attention"], "lora", rank=4, alpha=4.0,
                          name_map=name_map_for(model.params), init_weights="gaussian",
                          generator=flame.Generator("cpu").manual_seed(seed + 1))
        with flame.no_grad():  # a non-zero up-projection: the adapters change the output and get every gradient
            for _, p in A.named_adapter_parameters(model):
                p.copy_(flame.tensor(0.1 * rng.standard_normal(tuple(p.shape)), dtype=p.dtype, device=p.device))
    return model


def flux_inputs(device=None, batch=1, height=48, width=32, n_txt=5, seed=1, dtype=flame.float32):
    from flame_models.flux import sampling as S
    rng = np.random.default_rng(seed)
    L = (height // 16) * (width // 16)

    def t(a):
        return flame.tensor(a, dtype=dtype, device=device)
    return dict(img=t(rng.standard_normal((batch, L, 64))), img_ids=S.image_ids(height, width, batch, device=device),
                txt=t(rng.standard_normal((batch, n_txt, 32))), txt_ids=S.text_ids(n_txt, batch, device=device),
                timesteps=t(rng.uniform(0.1, 0.9, batch)), y=t(rng.standard_normal((batch, 16))),
                guidance=t(rng.uniform(1, 4, batch)))


def npy(t):
    return t.detach().float().cpu().numpy() if t is not None else None


class LazyCopyEngine:
    """The host engine with the copy stream made as late as the events allow: every copy is queued and runs only
    when the compute side waits on an event recorded after it (or at synchronize), reading its source then. A
    schedule missing a wait computes with stale weights; one that lets compute overwrite memory a queued copy still
    has to read copies the wrong bytes. Either way the results change, and the tests see it."""
    is_async = True

    def __init__(self, engine):
        self._eng, self.device, self.profile = engine, engine.device, False
        self.queue, self.done = [], 0
        self.wb_queue, self.wb_done = [], 0

    def record_compute(self):
        return None

    def h2d(self, dst, offset, src):
        self.queue.append(lambda: self._eng.h2d(dst, offset, src))

    def d2h(self, dst, src, offset):
        self.queue.append(lambda: self._eng.d2h(dst, src, offset))

    def record_copy(self):
        return len(self.queue)

    # the write-back stream: a queue of its own, run only when something waits on its event (or at synchronize)
    def writeback_waits(self, event):
        pass

    def writeback(self, dst, src, offset):
        self.wb_queue.append(lambda: self._eng.d2h(dst, src, offset))

    def record_writeback(self):
        return ("wb", len(self.wb_queue))

    def _run_wb(self, n):
        if self._eng.is_async and self.wb_done < n:
            from flame_core import backend
            backend.cupy.cuda.Device().synchronize()
        while self.wb_done < n:
            self.wb_queue[self.wb_done]()
            self.wb_done += 1
        self._eng.synchronize()

    def copy_waits(self, event):
        if type(event) is tuple:
            self._run_wb(event[1])

    def compute_waits(self, event):
        if type(event) is tuple:
            self._run_wb(event[1])
        elif event is not None:
            self._run(event)

    def _run(self, n):
        if self._eng.is_async and self.done < n:  # cuda: the compute queued so far must not race the copies
            from flame_core import backend
            backend.cupy.cuda.Device().synchronize()
        while self.done < n:
            self.queue[self.done]()
            self.done += 1
        self._eng.synchronize()  # on cuda the wrapped copies are asynchronous: finish them here

    def synchronize(self):
        self._run_wb(len(self.wb_queue))
        self._run(len(self.queue))

    def transfer_log(self):
        return []


def assert_same(actual, desired, device, err_msg="", cuda_rtol=1e-6):
    """Bitwise equal on cpu; on cuda within 1e-6 (the same kernels on the same inputs, but cuBLAS may pick another
    algorithm for another pointer alignment). Wrong weights give differences of order 1, so both catch them."""
    if str(device).startswith("cuda"):
        np.testing.assert_allclose(actual, desired, rtol=cuda_rtol, atol=cuda_rtol, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(actual, desired, err_msg=err_msg)


class CaptureViolation(AssertionError):
    pass


class CaptureCheckEngine:
    """A copy engine (the host one on the cpu: copies at once, exact numbers; the CUDA one on a GPU, whose own events
    still order the copies) plus a model of CUDA stream capture's rules, for tests of a streamed step captured as a
    graph. Inside `with eng.capture():` the compute stream is capturing, and:
      - the copy stream joins the capture only by waiting on an event recorded on the capturing compute stream (the
        fork); a copy or an event record on it before that would run eagerly, outside the graph: a violation;
      - waiting on an event recorded outside the capture, inside it, is a violation (and the reverse after it);
      - when the capture ends, the copy stream's last captured work must have been joined: the compute stream waited
        on an event recorded on the copy stream at or after it (else cudaStreamEndCapture fails: unjoined work).
    `log` keeps (what, stream, captured) of every operation."""
    is_async = True

    def __init__(self, engine):
        self._eng, self.device, self.profile = engine, engine.device, False
        self.capturing_now = False
        self.capture_id = 0
        self.forked = False
        self.seq = 0             # copy-stream operations so far
        self.tail = 0            # seq of the copy stream's last captured operation
        self.joined = 0          # highest copy-stream seq the compute stream waited for during the capture
        self.log = []
        self.copies_in_capture = 0

    # an event: (stream, captured-in capture id or None, copy seq at record, the wrapped engine's own event): the
    # model's bookkeeping, and the real event that orders an asynchronous (CUDA) engine's copies and reads as before
    def record_compute(self):
        ev = ("compute", self.capture_id if self.capturing_now else None, self.seq, self._eng.record_compute())
        self.log.append(("record", "compute", ev[1]))
        return ev

    def record_copy(self):
        if self.capturing_now and not self.forked:
            raise CaptureViolation("an event recorded on the copy stream during a capture before the copy stream "
                                   "joined it (it would be recorded eagerly, outside the graph)")
        ev = ("copy", self.capture_id if self.capturing_now else None, self.seq, self._eng.record_copy())
        if self.capturing_now:
            self.tail = self.seq
        self.log.append(("record", "copy", ev[1]))
        return ev

    def _check_event(self, ev, who):
        if ev is None:
            return
        captured = ev[1]
        if self.capturing_now and captured != self.capture_id:
            raise CaptureViolation(f"{who} waits, inside a capture, on an event recorded outside it")
        if not self.capturing_now and captured is not None:
            raise CaptureViolation(f"{who} waits, outside a capture, on an event recorded inside one")

    def copy_waits(self, event):
        self._check_event(event, "the copy stream")
        if self.capturing_now and event is not None and event[0] == "compute":
            self.forked = True
        self.log.append(("copy_waits", event))
        self._eng.copy_waits(None if event is None else event[3])

    def compute_waits(self, event):
        self._check_event(event, "the compute stream")
        if self.capturing_now and event is not None and event[0] == "copy":
            self.joined = max(self.joined, event[2])
        self.log.append(("compute_waits", event))
        self._eng.compute_waits(None if event is None else event[3])

    def _copy_op(self, what):
        if self.capturing_now:
            if not self.forked:
                raise CaptureViolation(f"a {what} on the copy stream during a capture before the copy stream joined "
                                       f"it: it would run eagerly, outside the graph")
            self.copies_in_capture += 1
        self.seq += 1
        if self.capturing_now:
            self.tail = self.seq

    def h2d(self, dst, offset, src):
        self._copy_op("host->device copy")
        self._eng.h2d(dst, offset, src)

    def d2h(self, dst, src, offset):
        self._copy_op("device->host copy")
        self._eng.d2h(dst, src, offset)

    def capturing(self):
        return ("capture", self.capture_id) if self.capturing_now else None

    def synchronize(self):
        if self.capturing_now:
            raise CaptureViolation("a stream synchronisation during a capture")
        self._eng.synchronize()

    def transfer_log(self):
        return []

    def capture(self):
        eng = self

        class _Ctx:
            def __enter__(self):
                eng.capture_id += 1
                eng.capturing_now, eng.forked = True, False
                eng.tail = eng.joined = eng.seq
                eng.copies_in_capture = 0
                return eng

            def __exit__(self, exc_type, exc, tb):
                eng.capturing_now = False
                if exc_type is None and eng.forked and eng.joined < eng.tail:
                    raise CaptureViolation(f"capture ended with copy-stream work not joined back (copy-stream "
                                           f"operation {eng.tail} captured, the compute stream waited up to "
                                           f"{eng.joined})")
                return False
        return _Ctx()
