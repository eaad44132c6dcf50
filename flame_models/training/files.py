"""Writing small files so that a crash never leaves a half-written one: flame_core.io.atomic_write (temp file in the
same folder -> fsync -> rename), then an fsync of the folder (the rename itself survives a power cut)."""
import json
import os

from flame_core.io import atomic_write


def fsync_dir(folder):
    """Make a rename or a new entry in `folder` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path, data):
    with atomic_write(path) as f:
        f.write(data)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path


def atomic_write_text(path, text):
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj, **kw):
    return atomic_write_text(path, json.dumps(obj, **kw))


def save_image(img, path):
    """A PIL image as a PNG, atomically."""
    import io
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return atomic_write_bytes(path, buf.getvalue())
