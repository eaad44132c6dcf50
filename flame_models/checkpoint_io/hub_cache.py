"""Hugging Face repo ids where a path is expected (ai-toolkit's `name_or_path: black-forest-labs/FLUX.1-dev`, its
`assistant_lora_path: ostris/FLUX.1-schnell-training-adapter`), read from the local Hugging Face cache that
huggingface_hub, diffusers and ai-toolkit fill. FLAME never downloads: a repo the cache lacks stays an error that says
how to fetch it.

The cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (huggingface_hub's order). A model repo
is its folder models--<org>--<name> (matched without regard to case when no folder matches exactly: Hub ids ignore
case, and the cache keeps the spelling the download asked for); its files are under snapshots/<revision>/, and
refs/main names the revision the last download of the main branch got. That revision is used; without refs/main, the
only snapshot. Several snapshots and no refs/main is an error listing them (which one the user means is not for FLAME
to guess). A revision named in refs/main must be a plain folder name under snapshots/ (the cache is someone else's
files).
"""
import os
import re

# org/name as the Hub allows them (letters, digits, '-', '_', '.'; no '..', no leading '-' or '.')
_REPO_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_FILE_SUFFIXES = (".safetensors", ".json", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".yaml", ".toml")


def looks_like_repo_id(value):
    """Whether `value` reads as a Hub repo id (org/name) and not as a path that exists or a file name."""
    return (isinstance(value, str) and bool(_REPO_ID.match(value)) and not os.path.exists(value)
            and not value.lower().endswith(_FILE_SUFFIXES))


def cache_root():
    """The Hub cache folder huggingface_hub would use."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


class HubCacheError(ValueError):
    """The cache holds the repo, but not one snapshot FLAME can pick."""


def snapshot(repo_id):
    """The folder of `repo_id`'s cached snapshot (refs/main's revision, else the only one), or None when the cache
    does not hold the repo. HubCacheError when it holds it ambiguously or refs/main names no snapshot."""
    org, name = repo_id.split("/")
    repo = _repo_folder(f"models--{org}--{name}")
    if repo is None:
        return None
    snaps = os.path.join(repo, "snapshots")
    if not os.path.isdir(snaps):
        return None
    ref = os.path.join(repo, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8", errors="replace") as f:
            rev = f.read(200).strip()
        if not re.fullmatch(r"[\w.-]{1,100}", rev) or rev in (".", ".."):
            raise HubCacheError(f"{ref}: not a revision name ({rev[:40]!r})")
        path = os.path.join(snaps, rev)
        if not os.path.isdir(path):
            raise HubCacheError(f"{ref} names revision {rev}, which {snaps} does not hold (an interrupted download?)")
        return path
    found = sorted(d for d in os.listdir(snaps) if os.path.isdir(os.path.join(snaps, d)))
    if len(found) == 1:
        return os.path.join(snaps, found[0])
    if not found:
        return None
    raise HubCacheError(f"{snaps} holds {len(found)} snapshots ({', '.join(found[:4])}) and no refs/main: give the "
                        f"path of the one to use")


def _repo_folder(folder):
    """The cache's folder `folder`, else the one whose name differs from it in case only (Hub ids ignore case:
    SimpleTuner asks for black-forest-labs/flux.1-dev, diffusers' examples for FLUX.1-dev, and the cache keeps the
    spelling asked for), else None; HubCacheError when several differ from it in case only."""
    root = cache_root()
    exact = os.path.join(root, folder)
    if os.path.isdir(os.path.join(exact, "snapshots")):
        return exact
    try:
        names = os.listdir(root)
    except OSError:
        return None
    near = sorted(n for n in names if n.lower() == folder.lower() and os.path.isdir(os.path.join(root, n, "snapshots")))
    if len(near) > 1:
        raise HubCacheError(f"{root} holds {', '.join(near)}: the same repo id in different cases; give the path of "
                            f"the snapshot to use")
    return os.path.join(root, near[0]) if near else None


def resolve(value):
    """The cached snapshot folder of `value` when it is a repo id the cache holds, else None (not a repo id, or one
    the cache lacks: the caller's own error adds fetch_hint). HubCacheError for an ambiguous or broken entry."""
    return snapshot(value) if looks_like_repo_id(value) else None


def fetch_hint(repo_id):
    """What to tell a user whose cache lacks `repo_id`."""
    return (f"a Hugging Face repo id? FLAME does not download, and the cache at {cache_root()} does not hold it: "
            f"`huggingface-cli download {repo_id}` fills it, or give a local path")
