"""The one walk of a data folder (images, captions, precomputed samples), with one policy for symbolic links.

A data folder may come from someone else, and a link in it may point anywhere (`cat.png -> /home/me/.ssh/id_rsa`,
`more -> /`). The policy, the same for files and folders:
- a link whose target (fully resolved) is inside the data folder is followed;
- a link whose target is outside it, or that is broken, is skipped, with a warning naming the link and its target;
- every file and folder is read once: a link to a file or folder already in the scan (a duplicate, or a loop such
  as `a/up -> ..`) is skipped with a warning, so loops cannot hang the walk. Real paths are scanned before links, so
  a file keeps its own name, not a link's.
Names starting with '.' (hidden files and folders, e.g. the `.flame_cache` inside a folder) are not walked. The data
folder itself may be a link: it is the user's choice.
"""
import os


def inside(path, root_real):
    """True when `path`, fully resolved, is `root_real` (an already resolved folder) or lies under it."""
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def link_problem(path, folder):
    """Why the link `path` is not followed ('a link to X, outside the data folder F' / 'a broken link'), or None
    (not a link, or one the policy follows)."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    if not inside(path, os.path.realpath(folder)):
        return f"a link to {target}, outside the data folder {folder}"
    if not os.path.exists(target):
        return f"a broken link (to {os.readlink(path)})"
    return None


def walk_files(folder, warn=None, recursive=True):
    """The files of `folder` (and its subfolders when `recursive`) under the link policy above, as paths through
    `folder` (a file reached through a followed link keeps the link's path), sorted by their path inside it.
    warn(message) is called for each link skipped and each folder that cannot be listed."""
    if not os.path.isdir(folder):
        return []
    return _Walk(folder, warn or (lambda message: None), recursive).run()


class _Walk:
    def __init__(self, folder, warn, recursive):
        self.folder, self.warn, self.recursive = folder, warn, recursive
        self.seen_dirs, self.seen_files = {os.path.realpath(folder)}, set()
        self.files, self.links = [], []

    def run(self):
        self.scan(self.folder)
        while self.links:    # in path order; links inside the folders they lead to come in the next round
            batch = sorted(self.links, key=self.relpath)
            self.links.clear()
            for path in batch:
                self.follow(path)
        return sorted(self.files, key=self.relpath)

    def relpath(self, path):
        return os.path.relpath(path, self.folder).replace(os.sep, "/")

    def scan(self, start):
        """The real (non-link) tree under `start`: its files kept, its links queued."""
        stack = [start]
        while stack:
            d = stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as ex:
                self.warn(f"{d}: cannot list the folder ({ex.strerror or ex}); skipped")
                continue
            for e in entries:
                if e.name.startswith("."):
                    continue
                if e.is_symlink():
                    self.links.append(e.path)
                elif e.is_dir(follow_symlinks=False):
                    if self.recursive:
                        self.seen_dirs.add(os.path.realpath(e.path))
                        stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    self.seen_files.add(os.path.realpath(e.path))
                    self.files.append(e.path)

    def follow(self, path):
        why = link_problem(path, self.folder)
        if why is not None:
            self.warn(f"{path}: {why}: skipped")
            return
        real = os.path.realpath(path)
        if os.path.isdir(real):
            if not self.recursive:
                return
            if real in self.seen_dirs:
                self.warn(f"{path}: a link to the folder {real}, which the scan already holds (a loop, or a second "
                          f"name): skipped")
                return
            self.seen_dirs.add(real)
            self.scan(path)
        elif os.path.isfile(real):
            if real in self.seen_files:
                self.warn(f"{path}: a link to {real}, which the scan already holds: skipped")
                return
            self.seen_files.add(real)
            self.files.append(path)
