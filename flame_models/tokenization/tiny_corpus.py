"""A few captions to learn tiny tokenizers from (the tiny random models of tests, demos and `-tiny` presets), so that
ordinary prompts tokenize into known pieces."""

TINY_CORPUS = [
    "a photo of a red square on a white background", "a blue circle in the middle of a green field",
    "a yellow triangle next to a black dot", "a small orange star above a purple line",
    "two red squares and one blue circle", "a drawing of a cat sitting on a chair",
    "a painting of a house by a lake at sunset", "an ohwx toy on a wooden table",
    "the quick brown fox jumps over the lazy dog", "a portrait of a woman with long hair",
    "a close up photo of a flower, soft light", "a city street at night with neon signs",
]
