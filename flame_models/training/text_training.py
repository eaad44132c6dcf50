"""The text encoders trained beside the denoiser (train.train_text_encoder; kohya's default for SDXL LoRAs,
ai-toolkit's train_text_encoder). Instead of caching embeddings the text stage (image_data.py) loads the encoders,
tokenises every caption the run can draw once (CaptionTokens stands in for the embedding cache: each sample carries
its caption's token ids) and keeps the encoders on the training device. TrainedTextEncoders then puts adapters on
their attention and MLP Linears (the family's text_encoder_targets) at the network's kind, rank and alpha (a
network.pretrained_lora_path's text-encoder adapters start those layers from the file's values); each
micro-step encodes the batch's ids through them with autograd inside the captured region (the ids are fixed-shape
inputs), their parameters train in their own optimizer group (train.text_encoder_lr, else train.lr), checkpoints
hold them (named '<component>/<module>...'), the LoRA file holds them under kohya's lora_te1_ / lora_te2_ or
diffusers' text_encoder. / text_encoder_2., and previews encode their prompts with them as they are at that step.
A full fine-tune (network.type full; SDXL) trains the encoders' own weights instead, held as the denoiser's are
(float32, or bf16 with train.full_bf16), and writes them into the model it saves (the family's save_model).
"""
import numpy as np

import flame_core as flame
from flame_core.autograd import no_grad
from flame_nn import adapters as A

from ..data.errors import DataError
from .network import dropouts


class CaptionTokens:
    """The text-embedding cache's stand-in when the text encoders train: `fill(captions)` tokenises the captions
    not seen yet (`tokenize(list) -> {key: (N, ...) int64}`); `load(caption)` -> {key: array} per caption."""

    def __init__(self, tokenize):
        self.tokenize = tokenize
        self.table = {}

    def missing(self, captions):
        return [c for c in dict.fromkeys(captions) if c not in self.table]

    def fill(self, captions):
        todo = self.missing(captions)
        if todo:
            ids = self.tokenize(todo)
            for i, c in enumerate(todo):
                self.table[c] = {k: np.ascontiguousarray(v[i]) for k, v in ids.items()}
        return len(todo)

    def load(self, caption):
        try:
            return self.table[caption]
        except KeyError:
            raise DataError(f"caption {caption!r:.80} was not tokenised before training") from None


def full_selection(family, encoders):
    """[('<component>/<name>', Parameter)]: every floating weight of the family's trainable text encoders -- what a
    full fine-tune trains of them (full_finetune.make_trainable's extra)."""
    return [(f"{comp}/{k}", p) for comp, te in family.trainable_text_encoders(encoders)
            for k, p in te.named_parameters() if p.dtype.is_floating_point]


class TrainedTextEncoders:
    """The family's text encoders (load_text_encoders' object) with adapters `name` "default" on every Linear of
    `family.text_encoder_targets`, trainable -- or, for a full fine-tune (network.type full), their own weights,
    made trainable by full_finetune.make_trainable (full_selection); see the module docstring."""

    def __init__(self, family, encoders, network, train, *, seed, pretrained=None):
        self.family, self.encoders = family, encoders
        self.parts = list(family.trainable_text_encoders(encoders))     # [(component, encoder)]
        n = network
        self.n_adapted = 0
        self.full = n.type == "full"
        if self.full:
            for _, te in self.parts:
                te.enable_gradient_checkpointing(train.gradient_checkpointing)
                te.train()
            named = self.named_parameters()
            if not named:
                raise ValueError("TrainedTextEncoders: a full fine-tune's text encoders hold no trainable weight "
                                 "(full_finetune.make_trainable with full_selection makes them trainable first)")
            self.n_adapted = len(named)
            self.params = [p for _, p in named]
            return
        for i, (comp, te) in enumerate(self.parts):
            # network.pretrained_lora_path: the file's adapters of this encoder first, from its values; the other
            # targeted layers start fresh
            part = pretrained.text_part(te, comp) if pretrained is not None else {}
            drops = dropouts(n)   # (kohya's, on the text encoders' adapters too)
            made = A.inject_from_state(te, part, dropout=n.dropout, rslora=n.rslora, **drops) if part else []
            made += A.inject_adapters(te, list(family.text_encoder_targets), "lora" if n.type == "locon" else n.type,
                                      rank=n.linear, alpha=n.linear_alpha, dropout=n.dropout, rslora=n.rslora,
                                      lokr_factor=n.lokr_factor, lokr_full_rank=n.lokr_full_rank,
                                      skip_adapted=bool(part), **drops,
                                      generator=flame.Generator("cpu").manual_seed(seed + 5 + i))
            self.n_adapted += len(made)
            te.enable_gradient_checkpointing(train.gradient_checkpointing)
            te.train()
        self.params = [p for _, te in self.parts for p in A.adapter_parameters(te)]

    def named_parameters(self):
        """[('<component>/<adapter parameter name>', Parameter)] (checkpoints); a full fine-tune's: its encoders'
        trained weights."""
        if self.full:
            return [(f"{comp}/{k}", p) for comp, te in self.parts for k, p in te.named_parameters() if p.requires_grad]
        return [(f"{comp}/{k}", p) for comp, te in self.parts for k, p in A.named_adapter_parameters(te)]

    def modules(self):
        """{component: encoder} for save_adapters(text_encoders=...)."""
        return dict(self.parts)

    def encode(self, cond):
        """The model's conditioning from the batch's token ids (inside the captured region)."""
        return self.family.encode_training_text(self.encoders, cond)

    def train(self, mode=True):
        for _, te in self.parts:
            te.train(mode)

    def preview_conditioning(self, texts, negative=None, multipliers=None):
        """[{key: array}] per text (the family's encode_prompts, "negative_<key>" from `negative`: one text for all,
        or a list of one text or None per text), encoded by the encoders as they are now (eval mode: no adapter
        dropout); multipliers: a weight of the encoders' adapters per text (a prompt's --m; None: 1)."""
        texts = list(texts)
        negs = list(negative) if isinstance(negative, (list, tuple)) else [negative] * len(texts)
        mults = [1.0 if m is None else float(m) for m in (multipliers or [None] * len(texts))]
        out = [None] * len(texts)
        self.train(False)
        try:
            with no_grad():
                for m in dict.fromkeys(mults):
                    idx = [i for i in range(len(texts)) if mults[i] == m]
                    self._weigh(m)
                    enc = self.family.encode_prompts(self.encoders, [texts[i] for i in idx])
                    kinds = list(dict.fromkeys(negs[i] for i in idx if negs[i] is not None))
                    neg = {} if not kinds else self.family.encode_prompts(self.encoders, kinds)
                    for j, i in enumerate(idx):
                        out[i] = {**{k: v[j] for k, v in enc.items()},
                                  **({} if negs[i] is None else
                                     {f"negative_{k}": v[kinds.index(negs[i])] for k, v in neg.items()})}
        finally:
            self._weigh(1.0)
            self.train(True)
        return out

    def _weigh(self, weight):
        """The encoders' adapters at `weight` (a full fine-tune has none)."""
        if not self.full:
            for _, te in self.parts:
                A.set_adapter_weight(te, "default", weight)
