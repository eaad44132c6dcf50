"""Per-prompt options of sample prompts, in the syntax kohya's sd-scripts and ai-toolkit share: the prompt's text, then
flags that each run to the next one --

    sample:
      prompts:
        - "a photo of [trigger] on a beach --w 768 --h 512 --d 7"
        - "[trigger] as an oil painting --s 30 --l 5.5 --n blurry, low quality"

  --w N / --h N            the preview's width / height (a multiple of the family's pixel multiple; default
                           sample.width / height)
  --d N, --seed N          its seed (default sample.seed, + the prompt's index with walk_seed)
  --s N, --steps N         its sampling steps (default sample.sample_steps)
  --l X, --cfg X, --g X    its guidance (sample.guidance_scale's meaning: Flux's guidance embedding, the CFG scale of
                           SD3 / SDXL / Chroma / Qwen-Image; ai-toolkit's --l / --cfg). kohya writes Flux's
                           embedded guidance as --g and a true-CFG scale as --l: both on one Flux prompt read --g
                           as the embedded guidance and --l as its true-CFG scale (sample.true_cfg's meaning; 1:
                           none); on a CFG family's prompt the two are one setting given twice (an error)
  --n TEXT                 its negative prompt (families whose previews run CFG with one: SD3, SDXL, Chroma,
                           Qwen-Image, and a Flux prompt that runs true CFG; default sample.neg)
  --ss NAME                its sampler (kohya's flag; one of the family's sample.sampler values)
  --m X, --network_multiplier X
                           the adapters' weight while it samples (ai-toolkit's flag; 1 is the LoRA as trained, 0 the
                           base model; with train.train_text_encoder the encoders' adapters too); not for a full
                           fine-tune
  --ctrl_img PATH          Flux Kontext: the image the prompt edits (ai-toolkit's flag)

A flag starts a word (`--w`, not `a--w`); its value runs to the next flag or the end, so a negative prompt or a path
may hold spaces. Flags this version does not take (ai-toolkit's --gr, --p2, --n2, ...; kohya's --cn, --am) and a flag
given twice are errors that name the prompt -- never read as prompt text or ignored.
"""
import math
import re
from dataclasses import dataclass

from .limits import MAX_SIDE  # (the generator's bound on a side)

MAX_STEPS = 1000

# flag -> field, in the two tools' spellings
FLAGS = {"w": "width", "h": "height", "d": "seed", "seed": "seed", "s": "steps", "steps": "steps",
         "l": "cfg", "cfg": "cfg", "g": "guidance", "n": "negative", "ss": "sampler",
         "m": "multiplier", "network_multiplier": "multiplier", "ctrl_img": "ctrl_img"}
_INTS = ("width", "height", "seed", "steps")
_FLAG = re.compile(r"(?:^|(?<=\s))--([A-Za-z_][A-Za-z0-9_]*)(?=\s|$)")


class PromptOptionError(ValueError):
    """A sample prompt's flag that cannot be read (the message names the flag and its value)."""


@dataclass(frozen=True)
class PromptOptions:
    text: str                      # the prompt without its flags
    width: int = None
    height: int = None
    seed: int = None
    steps: int = None
    guidance: float = None         # --g
    cfg: float = None              # --l / --cfg
    negative: str = None           # None: the run's negative (sample.neg); "" is an empty negative prompt
    sampler: str = None
    multiplier: float = None       # the adapters' weight while it samples (None: 1)
    ctrl_img: str = None           # None: none given; "" when the flag has no path

    @property
    def scale(self):
        """The preview's guidance: --g, else --l / --cfg, else None (sample.guidance_scale)."""
        return self.guidance if self.guidance is not None else self.cfg

    def size(self, height, width):
        """(height, width) of the preview: this prompt's, else the given defaults."""
        return (self.height or height, self.width or width)


def true_cfg_of(options, sample):
    """The true-CFG scale of a prompt's preview in a family that may run one (Flux): its --l beside --g (kohya's),
    else sample.true_cfg. `options`: the prompt's PromptOptions or None."""
    if options is not None and options.guidance is not None and options.cfg is not None:
        return options.cfg
    return sample.true_cfg


def runs_true_cfg(sample):
    """Whether a preview of a family that may run true CFG (Flux) does: a prompt's --l > 1 beside --g, or
    sample.true_cfg > 1 for the prompts without one (and for a run without prompts). A prompt whose flags do not
    read counts at sample.true_cfg (validation reports it)."""
    opts = []
    for text in sample.prompts or ():
        try:
            opts.append(parse(text) if isinstance(text, str) else None)
        except PromptOptionError:
            opts.append(None)
    return any(true_cfg_of(o, sample) > 1 for o in opts or [None])


def parse(prompt):
    """PromptOptions of a sample prompt; PromptOptionError for an unknown flag, a flag given twice or a value that
    does not read as its type."""
    marks = list(_FLAG.finditer(prompt))
    if not marks:
        return PromptOptions(prompt.strip())
    values = {}
    for k, m in enumerate(marks):
        flag = m.group(1)
        end = marks[k + 1].start() if k + 1 < len(marks) else len(prompt)
        raw = prompt[m.end():end].strip()
        name = FLAGS.get(flag)
        if name is None:
            raise PromptOptionError(f"--{flag}: not a sample-prompt option here; they are "
                                    f"{', '.join('--' + f for f in FLAGS)}")
        if name in values:
            raise PromptOptionError(f"--{flag}: the prompt sets its {name} twice")
        values[name] = _value(flag, name, raw)
    return PromptOptions(prompt[:marks[0].start()].strip(), **values)


def _value(flag, name, raw):
    if name in ("negative", "ctrl_img"):
        return raw
    if name == "sampler":
        if not raw or " " in raw:
            raise PromptOptionError(f"--{flag}: a sampler name, got {raw!r}")
        return raw
    try:
        v = int(raw) if name in _INTS else float(raw)
    except ValueError:
        raise PromptOptionError(f"--{flag}: {'an integer' if name in _INTS else 'a number'}, got {raw!r}") from None
    if name in ("width", "height") and not 0 < v <= MAX_SIDE:
        raise PromptOptionError(f"--{flag}: the preview's {name} in pixels, 1 to {MAX_SIDE}, got {v}")
    if name == "steps" and not 0 < v <= MAX_STEPS:
        raise PromptOptionError(f"--{flag}: sampling steps, 1 to {MAX_STEPS}, got {v}")
    if name == "seed" and not 0 <= v < 2 ** 63:
        raise PromptOptionError(f"--{flag}: a seed, 0 to 2**63 - 1, got {v}")
    if name in ("guidance", "cfg", "multiplier") and not math.isfinite(v):
        raise PromptOptionError(f"--{flag}: a finite {'weight' if name == 'multiplier' else 'guidance scale'}, "
                                f"got {raw!r}")
    return v


def problems(cfg, family, prefix=""):
    """What is wrong with the flags of sample.prompts for `family` (one message per problem, naming the prompt)."""
    e = []
    for i, text in enumerate(cfg.sample.prompts):
        if not isinstance(text, str):
            continue  # (reported with the fields)
        where = f"{prefix}sample.prompts[{i}]"
        try:
            o = parse(text)
        except PromptOptionError as ex:
            e.append(f"{where}: {ex}")
            continue
        mult = family.pixel_multiple
        for k in ("width", "height"):
            v = getattr(o, k)
            if v is not None and v % mult:
                e.append(f"{where}: --{k[0]} {v}: the {family.name} family's previews take multiples of {mult} px")
        if o.guidance is not None and o.cfg is not None:
            if family.takes_negative_prompt:
                e.append(f"{where}: --g and --l (--cfg) both set the {family.name} previews' CFG scale; give one")
            elif not family.true_cfg and o.cfg != 1:
                e.append(f"{where}: --l {o.cfg:g} beside --g: the {family.name} family's previews run no CFG (--g is "
                         f"its guidance); leave --l out or give --l 1")
            elif not o.cfg >= 1:
                e.append(f"{where}: --l {o.cfg:g} beside --g: the true-CFG scale, >= 1 (1: none)")
        if o.negative is not None and not family.takes_negative_prompt:
            if not family.true_cfg:
                e.append(f"{where}: --n: the {family.name} family's previews take no negative prompt (they sample "
                         f"with its guidance, no CFG)")
            elif not true_cfg_of(o, cfg.sample) > 1:
                e.append(f"{where}: --n: this {family.name} preview runs no true CFG, so no negative prompt (--l > 1 "
                         f"beside --g, or sample.true_cfg > 1, runs it)")
        if o.sampler is not None and o.sampler not in family.samplers:
            words = getattr(family, "sampler_words", None) or ", ".join(family.samplers) or "no named sampler"
            e.append(f"{where}: --ss {o.sampler}: {getattr(family, 'label', None) or family.name} previews use {words}")
        if o.multiplier is not None and cfg.network.type == "full":
            e.append(f"{where}: --m: a full fine-tune has no adapters to weigh (network.type full)")
        if o.ctrl_img is not None:
            if not family.control_images:
                e.append(f"{where}: --ctrl_img: the {family.name} family takes no control image (model.arch "
                         f"flux_kontext previews an edit of one)")
            elif not o.ctrl_img:
                e.append(f"{where}: --ctrl_img without a path (--ctrl_img <image file>)")
    return e
