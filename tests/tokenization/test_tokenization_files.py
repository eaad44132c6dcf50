"""Finding tokenizer folders in model folders, reading their configs, and clear errors when files are missing."""
import json

import pytest

from flame_core.errors import FlameError
from flame_models.tokenization import CLIPTokenizer, T5Tokenizer, TokenizerFilesError, load_tokenizer, packaged


@pytest.fixture
def sdxl_like(tmp_path, tiny_clip):
    """A diffusers-style root with CLIP-L in tokenizer/ and CLIP-G (pad "!") in tokenizer_2/ (tiny vocabularies)."""
    tiny_clip.save_pretrained(tmp_path / "tokenizer")
    type(tiny_clip).train_tiny(["a b c"], vocab_size=514, kind="clip_g").save_pretrained(tmp_path / "tokenizer_2")
    return tmp_path


def test_model_folder_layouts(sdxl_like, tiny_t5, tiny_clip):
    assert load_tokenizer("clip_l", sdxl_like).source == str(sdxl_like / "tokenizer")
    g = load_tokenizer("clip_g", sdxl_like)
    assert g.source == str(sdxl_like / "tokenizer_2") and g.pad_token_id == 0 and g.vocab_size == 514
    first = CLIPTokenizer.from_pretrained(sdxl_like)  # no kind: the first CLIP tokenizer, tokenizer/
    assert first.source == str(sdxl_like / "tokenizer") and first.pad_token_id == tiny_clip.eos_token_id
    assert CLIPTokenizer.from_pretrained(sdxl_like, "tokenizer_2").pad_token == "!"  # from the folder's config
    assert CLIPTokenizer.from_pretrained(sdxl_like / "tokenizer_2" / "vocab.json").pad_token == "!"
    tiny_t5.save_pretrained(sdxl_like / "tokenizer_3")  # SD3 layout
    assert load_tokenizer("t5", sdxl_like).source == str(sdxl_like / "tokenizer_3" / "spiece.model")
    tiny_t5.save_pretrained(sdxl_like / "flux" / "tokenizer_2")  # Flux layout: T5 in tokenizer_2
    tiny_clip.save_pretrained(sdxl_like / "flux" / "tokenizer")
    assert load_tokenizer("t5", sdxl_like / "flux").source == str(sdxl_like / "flux" / "tokenizer_2" / "spiece.model")
    assert load_tokenizer("clip_l", sdxl_like / "flux").source == str(sdxl_like / "flux" / "tokenizer")


def test_config_rules(tmp_path, tiny_clip):
    folder = tiny_clip.save_pretrained(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # An AddedToken dict, a length limit, and transformers' "no limit" sentinel.
    config.update(pad_token={"__type": "AddedToken", "content": "!", "lstrip": False}, model_max_length=64)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = CLIPTokenizer.from_pretrained(folder)
    assert (tok.pad_token_id, tok.model_max_length) == (0, 64)
    assert CLIPTokenizer.from_pretrained(folder, max_length=77, pad_token="<|endoftext|>").pad_token_id == \
        tiny_clip.eos_token_id
    config["model_max_length"] = 1000000000000000019884624838656
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert CLIPTokenizer.from_pretrained(folder).model_max_length == 77
    # special_tokens_map.json wins over the config, unless the config has added_tokens_decoder (transformers' rule).
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    assert CLIPTokenizer.from_pretrained(folder).pad_token == "<|endoftext|>"
    config["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert CLIPTokenizer.from_pretrained(folder).pad_token == "!"
    config["pad_token"] = "<not-a-token>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'<not-a-token>'\] are not in its vocabulary"):
        CLIPTokenizer.from_pretrained(folder)


def test_missing_files_name_the_folder(tmp_path):
    empty = tmp_path / "FLUX.1-dev"
    empty.mkdir()
    for kind in ("clip_l", "clip_g", "t5"):
        with pytest.raises(TokenizerFilesError, match=rf"no \w+ tokenizer files in {empty}.*path=None") as info:
            load_tokenizer(kind, empty)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, FlameError)
    with pytest.raises(TokenizerFilesError, match=rf"{tmp_path / 'nowhere'} does not exist"):
        load_tokenizer("t5", tmp_path / "nowhere")
    ckpt = tmp_path / "flux1-dev.safetensors"
    ckpt.write_bytes(b"\0" * 16)
    single = r"is a file, not a tokenizer folder \(a single-file checkpoint.*vocab.json \+ merges.txt"
    with pytest.raises(TokenizerFilesError, match=single):
        load_tokenizer("clip_l", ckpt)
    with pytest.raises(TokenizerFilesError, match=rf"no tokenizer files in {empty / 'tokenizer_2'}"):
        load_tokenizer("t5", empty, subfolder="tokenizer_2")
    (empty / "tokenizer").mkdir()
    (empty / "tokenizer" / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerFilesError, match="has vocab.json but no merges.txt"):
        load_tokenizer("clip_l", empty)


def test_wrong_kind_of_tokenizer(tmp_path, tiny_clip, tiny_t5):
    tiny_t5.save_pretrained(tmp_path / "t5")
    tiny_clip.save_pretrained(tmp_path / "clip")
    with pytest.raises(TokenizerFilesError, match=r"holds a Unigram/SentencePiece \(T5-style\) tokenizer"):
        CLIPTokenizer.from_pretrained(tmp_path / "t5")
    with pytest.raises(TokenizerFilesError, match=r"holds a BPE \(CLIP-style\) tokenizer"):
        T5Tokenizer.from_pretrained(tmp_path / "clip")
    with pytest.raises(ValueError, match="kind must be"):
        load_tokenizer("clip_h")
    with pytest.raises(ValueError, match="kind must be"):
        CLIPTokenizer.from_pretrained(tmp_path / "clip", kind="t5")


def test_corrupt_files_are_named(tmp_path):
    bad_json = tmp_path / "a"
    bad_json.mkdir()
    (bad_json / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{bad_json / 'tokenizer.json'} is not a valid JSON file"):
        T5Tokenizer.from_pretrained(bad_json)
    bad_sp = tmp_path / "b"
    bad_sp.mkdir()
    (bad_sp / "spiece.model").write_bytes(b"definitely not a protobuf")
    with pytest.raises(ValueError, match=rf"{bad_sp / 'spiece.model'} is not a SentencePiece model"):
        T5Tokenizer.from_pretrained(bad_sp)
    bad_merges = tmp_path / "c"
    bad_merges.mkdir()
    (bad_merges / "vocab.json").write_text("{}")
    (bad_merges / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match=r"merges.txt line 2: a merge is two tokens"):
        CLIPTokenizer.from_pretrained(bad_merges)
    (bad_merges / "merges.txt").write_text("#version: 0.2\na b\n")
    (bad_merges / "vocab.json").write_text('{"a": 0, "<|startoftext|>": 1, "<|endoftext|>": 2}')
    with pytest.raises(ValueError, match=rf"CLIP tokenizer from {bad_merges}: .*Token `b` out of vocabulary"):
        CLIPTokenizer.from_pretrained(bad_merges)
    (bad_json / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["a", 0.0]],
                                                                   "unk_id": 5}}))
    with pytest.raises(ValueError, match=rf"{bad_json / 'tokenizer.json'}: .*unk_id"):
        T5Tokenizer.from_pretrained(bad_json)


def test_missing_packaged_vocabulary_names_the_folder_needed(tmp_path, monkeypatch):
    class Nowhere:
        def joinpath(self, *parts):
            return tmp_path.joinpath(*parts)

    monkeypatch.setattr(packaged.resources, "files", lambda _: Nowhere())
    packaged.read_packaged.cache_clear()
    try:
        with pytest.raises(TokenizerFilesError, match=r"t5_tokenizer.json.gz\) is missing .* tokenizer_2/ \(Flux\)"):
            load_tokenizer("t5")
        with pytest.raises(TokenizerFilesError, match=r"missing .* tokenizer_2/ \(CLIP-G\)"):
            load_tokenizer("clip_g")
        (tmp_path / "vocab").mkdir()
        (tmp_path / "vocab" / "clip_merges.txt.gz").write_bytes(b"not gzip")
        with pytest.raises(TokenizerFilesError, match=r"clip_merges.txt.gz is damaged.*tokenizer/ \(CLIP-L\)"):
            load_tokenizer("clip_l")
    finally:
        packaged.read_packaged.cache_clear()


def test_save_pretrained_round_trip_is_atomic(tmp_path, clip_g, tiny_t5, t5):
    captions = ["a photo of a cat", "東京 🐱 wow!", ""]
    for tok, name in ((clip_g, "clip_g"), (tiny_t5, "tiny_t5"), (t5, "t5")):
        folder = tok.save_pretrained(tmp_path / name)
        again = type(tok).from_pretrained(folder)
        assert again(captions).input_ids.tolist() == tok(captions).input_ids.tolist(), name
        assert (again.pad_token_id, again.model_max_length, again.vocab_size) == \
            (tok.pad_token_id, tok.model_max_length, tok.vocab_size)
    assert not list(tmp_path.rglob("*.tmp"))
