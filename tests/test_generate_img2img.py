"""Image-to-image from `python -m flame_models.generate --init-image` and generate(init_image=, strength=): the
image read, scaled and encoded by the family's VAE, handed to its sampler (the same pixels as the parts run by
hand), strength 1 giving the text-to-image picture on the flow families, the size taken from the image, the PNG
parameters, and bad input refused before anything is loaded (exit 2, named)."""
import json
import os

import numpy as np
import pytest
from PIL import Image, ImageFilter

import flame_core as flame
from flame_models.bfl.tiny import tiny_flux_files
from flame_models.generate import GenerateError, generate, init_size, main, read_init_image

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SD3 = os.path.join(FIXTURES, "sd3_pipeline", "pipeline")
QUIET = dict(progress=False, log=lambda *a: None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_flux_files(tmp_path_factory.mktemp("tiny") / "flux", seed=1)


@pytest.fixture(scope="module")
def init_png(tmp_path_factory):
    """A 56 x 40 picture (a gradient with a square: not noise)."""
    y, x = np.mgrid[0:40, 0:56]
    a = np.stack([x * 4, y * 6, (x + y) * 2], -1).astype(np.uint8)
    a[10:30, 20:40] = (250, 30, 30)
    path = tmp_path_factory.mktemp("init") / "init.png"
    Image.fromarray(a).save(path)
    return str(path)


def pixels(images):
    return np.stack([np.asarray(im).astype(np.int16) for im in images])


def test_the_image_is_scaled_to_cover_and_centre_cropped(init_png):
    x = read_init_image(init_png, 32, 32)               # 56 x 40 -> 45 x 32, cropped to its middle 32 columns
    assert x.shape == (1, 3, 32, 32) and x.dtype == np.float32
    assert -1.0 <= x.min() and x.max() <= 1.0
    red = (x[0, 0] > 0.8) & (x[0, 1] < -0.6)
    cols = np.nonzero(red.any(0))[0]
    assert 5 <= cols.min() and cols.max() <= 26            # the square stays in the middle
    assert init_size(init_png, None, None) == (48, 32)      # the image's size floored to 16
    assert init_size(init_png, 96, None) == (96, 64)        # the other side at its aspect ratio (68.6)
    assert init_size(init_png, None, None, 32) == (32, 32)
    assert init_size(None, None, None) == (1024, 1024) and init_size(None, 64, None) == (64, 1024)


def test_flux_img2img_is_the_parts_run_by_hand(tiny, init_png):
    """generate(init_image=) equals: the image read and scaled, encoded by Flux's VAE, sample_latents with
    init_latents and strength, decoded."""
    from flame_models.flux import pipeline as P
    from flame_models.pipeline import to_pil
    got = pixels(generate(tiny, "a red square", steps=4, seed=3, init_image=init_png, strength=0.5, **QUIET))
    assert got.shape == (1, 32, 48, 3)                      # the image's size, floored to 16
    F32 = flame.float32
    vae = P.load_vae_for_flux(tiny, dtype=F32, device="cpu")
    init = P.encode_images(vae, flame.tensor(read_init_image(init_png, 48, 32), device="cpu"))
    with P.load_text_encoders(tiny, dtype=F32, device="cpu") as enc:
        cond = enc.encode(["a red square"])
    model = P.load_transformer(tiny, dtype=F32, device="cpu")
    z = P.sample_latents(model, cond, height=32, width=48, steps=4, guidance=3.5, seeds=[3], init_latents=init,
                         strength=0.5)
    want = pixels(to_pil(P.decode_latents(vae, z)))
    np.testing.assert_array_equal(got, want)
    # strength 1 starts from pure noise at sigma 1: the text-to-image picture; a lower one another
    t2i = pixels(generate(tiny, "a red square", steps=4, seed=3, width=48, height=32, **QUIET))
    full = pixels(generate(tiny, "a red square", steps=4, seed=3, init_image=init_png, strength=1.0, **QUIET))
    np.testing.assert_array_equal(full, t2i)
    assert np.abs(got - t2i).max() > 0
    with pytest.raises(ValueError, match="strength and mask apply to image-to-image"):
        P.sample_latents(model, cond, height=32, width=48, steps=4, guidance=3.5, seeds=[3], strength=0.5)
    with pytest.raises(ValueError, match=r"init_latents of shape \(1, 16, 4, 4\) do not fit"):
        P.sample_latents(model, cond, height=32, width=48, steps=4, guidance=3.5, seeds=[3],
                         init_latents=np.zeros((1, 16, 4, 4), np.float32))


def test_command_writes_the_strength_into_the_png(tiny, init_png, tmp_path):
    out = tmp_path / "out"
    rc = main(["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--init-image", init_png, "--strength",
               "0.75", "--steps", "4", "--width", "32", "--seed", "5", "--output", str(out), "--no-progress",
               "--device", "cpu", "--dtype", "fp32"])
    assert rc == 0
    (name,) = os.listdir(out)
    im = Image.open(out / name)
    assert im.size == (32, 16)                              # --width 32: the height at 56 x 40's ratio, floored
    assert "Size: 32x16, Denoising strength: 0.75, Model" in im.text["parameters"]
    info = json.loads(im.text["flame"])
    assert info["init_image"] == init_png and info["strength"] == 0.75


def _fails(capsys, argv, *needles):
    rc = main(argv + ["--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    for n in needles:
        assert n in err, (n, err)


def test_bad_img2img_input_is_refused_before_loading(tiny, init_png, tmp_path, capsys):
    root = os.path.dirname(tiny.transformer)
    base = ["--model", root, "--prompt", "x", "--steps", "4", "--output", str(tmp_path / "o")]
    _fails(capsys, base + ["--strength", "0.5"], "--strength: applies to image-to-image; pass --init-image")
    _fails(capsys, base + ["--init-image", init_png, "--strength", "1.5"], "--strength", "(0, 1]")
    _fails(capsys, base + ["--init-image", init_png, "--strength", "0"], "--strength", "(0, 1]")
    missing = str(tmp_path / "nope.png")
    _fails(capsys, base + ["--init-image", missing], f"--init-image {missing}")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    _fails(capsys, base + ["--init-image", str(bad), "--width", "32", "--height", "32"], f"--init-image {bad}",
           "cannot read the image")
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
    with pytest.raises(GenerateError, match="--strength"):
        generate(tiny, "x", steps=4, strength=0.3, **QUIET)


def test_flux_kontext_refuses_an_init_image(tiny, init_png, tmp_path, capsys):
    folder = tmp_path / "kontext"
    import shutil
    shutil.copytree(os.path.dirname(tiny.transformer), folder)
    index = folder / "model_index.json"
    meta = json.loads(index.read_text())
    meta["_class_name"] = "FluxKontextPipeline"
    index.write_text(json.dumps(meta))
    _fails(capsys, ["--model", str(folder), "--prompt", "x", "--image", init_png, "--init-image", init_png],
           "--init-image:", "this model is Flux Kontext", "it edits the reference image given with --image")


def test_sd3_img2img(init_png):
    """SD3 (the tiny diffusers pipeline of the fixtures): strength 1 is the text-to-image picture, 0.6 another."""
    kw = dict(steps=3, seed=2, **QUIET)
    t2i = pixels(generate(SD3, "a cat", width=48, height=32, **kw))
    full = pixels(generate(SD3, "a cat", init_image=init_png, strength=1.0, **kw))
    part = pixels(generate(SD3, "a cat", init_image=init_png, strength=0.6, **kw))
    np.testing.assert_array_equal(full, t2i)
    assert part.shape == t2i.shape and np.abs(part - t2i).max() > 0


def test_sdxl_img2img(tmp_path, init_png, capsys):
    """SDXL (the tiny fixture): an image-to-image run differs with the strength; its size is floored to 32; lcm and a
    strength that leaves no step are refused."""
    from sdxl_tiny import sdxl_tiny_folder
    folder = sdxl_tiny_folder(tmp_path / "sdxl-tiny")
    kw = dict(steps=4, seed=2, **QUIET)
    a = pixels(generate(folder, "a cat", init_image=init_png, strength=0.5, **kw))
    b = pixels(generate(folder, "a cat", init_image=init_png, strength=0.75, **kw))
    assert a.shape == (1, 32, 32, 3) and np.abs(a - b).max() > 0
    base = ["--model", folder, "--prompt", "x", "--init-image", init_png, "--output", str(tmp_path / "o")]
    _fails(capsys, base + ["--sampler", "lcm", "--steps", "4"], "--init-image", "lcm is not supported")
    _fails(capsys, base + ["--steps", "2", "--strength", "0.3"], "--strength", "runs no step")


def test_chroma_and_qwen_image_img2img_at_strength_one_are_text_to_image(tmp_path, init_png):
    from flame_models.chroma.tiny import tiny_chroma_files
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    chroma = os.path.dirname(tiny_chroma_files(tmp_path / "Chroma-tiny", seed=4).transformer)
    qwen = tiny_qwen_image_folder(tmp_path / "Qwen-Image-tiny", seed=4)
    for model in (chroma, qwen):
        kw = dict(steps=3, seed=2, **QUIET)
        t2i = pixels(generate(model, "a cat", width=48, height=32, **kw))
        full = pixels(generate(model, "a cat", init_image=init_png, strength=1.0, **kw))
        part = pixels(generate(model, "a cat", init_image=init_png, strength=0.5, **kw))
        np.testing.assert_array_equal(full, t2i)
        assert np.abs(part - t2i).max() > 0, model


def test_img2img_images_do_not_depend_on_the_batch(tiny, tmp_path, init_png):
    """Image j of a prompt starts from seed + j's noise over the same image: a batch of two equals the two run
    alone (Flux; SDXL with a sampler that draws step noise, image by image)."""
    kw = dict(steps=4, seed=11, init_image=init_png, strength=0.6, **QUIET)
    both = pixels(generate(tiny, "a red square", num_images=2, batch_size=2, **kw))
    second = pixels(generate(tiny, "a red square", **dict(kw, seed=12)))
    np.testing.assert_array_equal(both[1:], second)
    assert np.abs(both[0] - both[1]).max() > 0
    from sdxl_tiny import sdxl_tiny_folder
    folder = sdxl_tiny_folder(tmp_path / "sdxl-tiny")
    kw = dict(kw, sampler="euler_ancestral", strength=0.5)
    both = pixels(generate(folder, "a cat", num_images=2, batch_size=2, **kw))
    second = pixels(generate(folder, "a cat", **dict(kw, seed=12)))
    np.testing.assert_array_equal(both[1:], second)


def _mask_png(tmp_path, value, size=(56, 40)):
    path = tmp_path / f"mask_{value}.png"
    Image.new("L", size, value).save(path)
    return str(path)


def test_inpainting_from_the_command_keeps_the_image_outside_the_mask(tiny, init_png, tmp_path):
    """--mask black everywhere: the image's own latents come out (its VAE round trip); white everywhere: the
    text-to-image picture (strength 1, the default with a mask); the PNG names the mask."""
    from flame_models.flux import pipeline as P
    from flame_models.pipeline import to_pil
    kw = dict(steps=4, seed=3, init_image=init_png, **QUIET)
    kept = pixels(generate(tiny, "a red square", mask=_mask_png(tmp_path, 0), **kw))
    vae = P.load_vae_for_flux(tiny, dtype=flame.float32, device="cpu")
    z = P.encode_images(vae, flame.tensor(read_init_image(init_png, 48, 32), device="cpu"))
    round_trip = pixels(to_pil(P.decode_latents(vae, z)))
    assert np.abs(kept - round_trip).max() <= 1
    repaint = pixels(generate(tiny, "a red square", mask=_mask_png(tmp_path, 255), **kw))
    t2i = pixels(generate(tiny, "a red square", steps=4, seed=3, width=48, height=32, **QUIET))
    np.testing.assert_array_equal(repaint, t2i)
    out = tmp_path / "out"
    mask = _mask_png(tmp_path, 128)
    assert main(["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--init-image", init_png, "--mask",
                 mask, "--steps", "3", "--output", str(out), "--no-progress", "--device", "cpu"]) == 0
    info = json.loads(Image.open(out / os.listdir(out)[0]).text["flame"])
    assert info["mask"] == mask and info["strength"] == 1.0


def test_sdxl_inpainting_with_a_black_mask_is_the_round_trip(tmp_path, init_png):
    from sdxl_tiny import sdxl_tiny_folder

    from flame_models.pipeline import to_pil
    from flame_models.sdxl import pipeline as P
    from flame_models.sdxl.components import find_sdxl_files
    folder = sdxl_tiny_folder(tmp_path / "sdxl-tiny")
    kept = pixels(generate(folder, "a cat", steps=4, seed=2, init_image=init_png, mask=_mask_png(tmp_path, 0),
                           sampler="dpmpp_2m", **QUIET))
    vae = P.load_vae_for_sdxl(find_sdxl_files(folder), dtype=flame.float32, device="cpu")
    z = P.encode_images(vae, flame.tensor(read_init_image(init_png, 32, 32), device="cpu"))
    assert np.abs(kept - pixels(to_pil(P.decode_latents(vae, z)))).max() <= 1


def test_bad_masks_are_refused(tiny, init_png, tmp_path, capsys):
    base = ["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--steps", "3", "--output",
            str(tmp_path / "o")]
    _fails(capsys, base + ["--mask", _mask_png(tmp_path, 0)], "--mask: applies to image-to-image; pass --init-image")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    _fails(capsys, base + ["--init-image", init_png, "--mask", str(bad)], f"--mask {bad}", "cannot read the image")


def test_the_init_image_is_encoded_in_tiles_when_it_does_not_fit():
    """encode_init_image: an out-of-memory error from the whole image turns tiling on and encodes again (once)."""
    from flame_models.generate import encode_init_image

    class Vae:   # what encode_init_image reads of a VAE
        use_tiling = None

        def parameters(self):
            return iter([flame.zeros(1, device="cpu")])

        def enable_tiling(self):
            self.use_tiling = True
    calls, logs = [], []

    def encode(vae, x):
        calls.append(vae.use_tiling)
        if vae.use_tiling is not True:
            raise flame.OutOfMemoryError("too large")
        return x[:, :1] * 2
    out = encode_init_image(np.ones((1, 3, 8, 8), np.float32), Vae, encode, "cpu", logs.append)
    assert calls == [None, True] and out.shape == (1, 1, 8, 8) and float(out.max()) == 2.0
    assert any("encoding in tiles" in m for m in logs)

    def always(vae, x):
        raise flame.OutOfMemoryError("still too large")
    with pytest.raises(flame.OutOfMemoryError):
        encode_init_image(np.ones((1, 3, 8, 8), np.float32), Vae, always, "cpu", logs.append)


def test_pil_images_given_in_memory(tiny, init_png, tmp_path):
    """generate(init_image=<PIL image>, mask=<PIL image>) gives what their files give; the PNG names them by size;
    one over the pixel limit is refused naming it."""
    mask_path = _mask_png(tmp_path, 255)
    kw = dict(steps=3, seed=4, strength=0.7, **QUIET)
    with Image.open(init_png) as a, Image.open(mask_path) as b:
        im, m = a.copy(), b.copy()
    from_files = pixels(generate(tiny, "x", init_image=init_png, mask=mask_path, **kw))
    out = tmp_path / "out"
    given = pixels(generate(tiny, "x", init_image=im, mask=m, output=str(out), **kw))
    np.testing.assert_array_equal(given, from_files)
    info = json.loads(Image.open(out / os.listdir(out)[0]).text["flame"])
    assert info["init_image"] == "<image 56x40>" and info["mask"] == "<image 56x40>"
    from flame_models.data.errors import DataError
    from flame_models.data.images import as_rgb
    with pytest.raises(DataError, match="init_image: the image is 56x40 = 2240 pixels"):
        as_rgb(im, "init_image", max_pixels=100)


def test_paste_back_puts_the_original_pixels_outside_the_mask(tiny, init_png, tmp_path, capsys):
    a = np.zeros((40, 56), np.uint8)
    a[:, 28:] = 255                                     # repaint the right half
    mask = str(tmp_path / "half.png")
    Image.fromarray(a).save(mask)
    kw = dict(steps=3, seed=4, init_image=init_png, mask=mask, **QUIET)
    plain = pixels(generate(tiny, "x", **kw))
    pasted = pixels(generate(tiny, "x", paste_back=True, **kw))
    orig = np.round((read_init_image(init_png, 48, 32)[0].transpose(1, 2, 0) + 1.0) * 127.5)
    np.testing.assert_array_equal(pasted[0, :, :20], orig[:, :20])      # kept: the original's pixels
    np.testing.assert_array_equal(pasted[0, :, 28:], plain[0, :, 28:])   # repainted: as without pasting
    assert np.abs(plain[0, :, :20] - orig[:, :20]).max() > 0             # (the round trip differs)
    _fails(capsys, ["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--init-image", init_png,
                    "--paste-back", "--output", str(tmp_path / "o")], "--paste-back: applies to inpainting")


def test_mask_grow_and_blur(tiny, init_png, tmp_path, capsys):
    """--mask-grow / --mask-blur give the picture of the mask grown and blurred beforehand (read_mask's order: grow,
    blur, at the mask's own size); the PNG records A1111's "Mask blur" and the flame JSON both; bad values, the
    options without a mask and a Kontext model are refused naming them."""
    from flame_models.samplers.inpaint import grow_mask
    a = np.zeros((40, 56), np.uint8)
    a[12:28, 30:44] = 255
    mask = str(tmp_path / "box.png")
    Image.fromarray(a).save(mask)
    edited = Image.fromarray(grow_mask(a, 4), "L").filter(ImageFilter.GaussianBlur(2.0))
    kw = dict(steps=3, seed=4, init_image=init_png, **QUIET)
    plain = pixels(generate(tiny, "x", mask=mask, **kw))
    out = tmp_path / "out"
    got = pixels(generate(tiny, "x", mask=mask, mask_grow=4, mask_blur=2, output=str(out), **kw))
    np.testing.assert_array_equal(got, pixels(generate(tiny, "x", mask=edited, **kw)))
    assert np.abs(got - plain).max() > 0
    im = Image.open(out / os.listdir(out)[0])
    assert "Denoising strength: 1, Mask blur: 2, Model" in im.text["parameters"]
    info = json.loads(im.text["flame"])
    assert info["mask_grow"] == 4 and info["mask_blur"] == 2.0
    root = os.path.dirname(tiny.transformer)
    base = ["--model", root, "--prompt", "x", "--steps", "3", "--output", str(tmp_path / "o")]
    _fails(capsys, base + ["--init-image", init_png, "--mask-blur", "3"], "--mask-blur: applies to inpainting")
    _fails(capsys, base + ["--mask-grow", "3"], "--mask-grow: applies to inpainting")
    _fails(capsys, base + ["--init-image", init_png, "--mask", mask, "--mask-grow", "300"], "--mask-grow: grow",
           "[-256, 256]")
    _fails(capsys, base + ["--init-image", init_png, "--mask", mask, "--mask-blur", "-1"], "--mask-blur: blur")
    _fails(capsys, base + ["--init-image", init_png, "--mask", mask, "--mask-blur", "nan"], "--mask-blur: blur")
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
    folder = tmp_path / "kontext"
    import shutil
    shutil.copytree(root, folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps(dict(json.loads(index.read_text()), _class_name="FluxKontextPipeline")))
    _fails(capsys, ["--model", str(folder), "--prompt", "x", "--image", init_png, "--mask-blur", "2"],
           "--mask-blur:", "this model is Flux Kontext", "it edits the reference image")
