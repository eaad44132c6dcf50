"""Qwen-Image's prompt encoding as QwenImagePipeline._get_qwen_prompt_embeds: each prompt in the chat template, the
Qwen2.5-VL language model's last hidden state (after its final norm), each sample's valid tokens without the first 34
(the system turn and `<|im_start|>user\\n`; the closing `<|im_end|>\\n<|im_start|>assistant\\n` tokens are kept),
re-padded with zeros to the longest, a mask of 1 on the kept tokens, cut to max_sequence_length.

`encode_prompts` takes a `tokenize(texts, max_length) -> (input_ids, attention_mask)`, right-padded, as the
pipeline's tokenizer with padding=True and truncation at 1024 + 34: flame_models.tokenization.qwen2.Qwen2Tokenizer."""
import numpy as np

import flame_core as flame

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                   "{}<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34                  # prompt_template_encode_start_idx
TOKENIZER_MAX_LENGTH = 1024       # + DROP_TOKENS: the tokenizer's max_length
MAX_SEQUENCE_LENGTH = 512         # QwenImagePipeline.__call__'s default (at most 1024)


def prompt_embeds_from_states(hidden, attention_mask, max_sequence_length=MAX_SEQUENCE_LENGTH, drop=DROP_TOKENS):
    """(prompt_embeds (B, L, D) float32, prompt_mask (B, L) float32) from the text encoder's states (B, T, D) and
    its attention mask (B, T) (NumPy arrays or tensors): per sample the valid tokens after the first `drop`,
    zero-padded to the longest, cut to max_sequence_length."""
    if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
        raise ValueError(f"max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_sequence_length}")
    h = hidden.float().numpy() if isinstance(hidden, flame.Tensor) else np.asarray(hidden, np.float32)
    m = attention_mask.numpy() if isinstance(attention_mask, flame.Tensor) else np.asarray(attention_mask)
    if h.ndim != 3 or m.shape != h.shape[:2]:
        raise ValueError(f"hidden states {h.shape} and attention mask {m.shape} do not fit")
    kept = [h[b][m[b] != 0][drop:] for b in range(h.shape[0])]
    n = max(1, max(len(k) for k in kept))
    embeds = np.zeros((h.shape[0], n, h.shape[2]), np.float32)
    mask = np.zeros((h.shape[0], n), np.float32)
    for b, k in enumerate(kept):
        embeds[b, :len(k)], mask[b, :len(k)] = k, 1.0
    return embeds[:, :max_sequence_length], mask[:, :max_sequence_length]


def encode_prompts(text_encoder, tokenize, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH):
    """{"prompt_embeds", "prompt_mask"} of `prompts` (strings) as the pipeline makes them; text_encoder a
    Qwen2_5_VLTextModel, tokenize(texts) -> (input_ids, attention_mask) (B, T) right-padded."""
    texts = [PROMPT_TEMPLATE.format(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
    ids, mask = tokenize(texts, max_length=TOKENIZER_MAX_LENGTH + DROP_TOKENS)
    with flame.no_grad():
        out = text_encoder(ids, attention_mask=mask, output_hidden_states=True)
    embeds, pmask = prompt_embeds_from_states(out.hidden_states[-1], mask, max_sequence_length)
    return {"prompt_embeds": embeds, "prompt_mask": pmask}
