"""Writing small files so that a crash never leaves a half-written one: temp file in the same folder -> fsync ->
rename -> fsync of the folder (the rename itself survives a power cut)."""
import json
import os
import tempfile


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
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)
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
