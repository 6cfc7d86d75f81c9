"""A job's log glob expanded with the job user's authority and a bounded cost: the newest files, not all of them.

`glob.glob` lists every directory with the agent's authority and returns every match; a user who puts 300,000 files
where their job's logs are globbed (`{workdir}/logs/*.log`) then makes every run list and stat them all. Here each
directory is listed as the job's user could list it (walked with `access.resolve`, readable and searchable by them),
entries are examined up to a cap per pattern and run (the directory's order: those past the cap are not seen this
run), each name is matched in linear time (RE2), only a matching entry is stat'ed, and a bounded heap keeps the
newest `keep` regular files by mtime. A symlink is followed with the user's authority. As with `glob`, `*` and `?`
do not match a leading dot.
"""

from __future__ import annotations

import glob
import heapq
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from trainguard.core.budget import NO_DEADLINE, Deadline
from trainguard.core.text import Pattern, linear
from trainguard.node.access import R_OK, X_OK, Identity, resolve, stat_as


@dataclass(frozen=True)
class Matches:
    paths: tuple[str, ...]  # the newest `keep` regular files that match, in name order
    matched: int  # matching regular files among the entries examined
    examined: int  # directory entries examined (and paths stat'ed for a literal last component)
    cut: bool  # the cap on entries examined stopped the walk: more entries were not seen


def _text(name: str) -> bytes:
    """A name as RE2 matches it: UTF-8, the bytes of a name that is not (surrogate escapes) each one U+FFFD, so that
    `*` and `?` match them as glob's one character each."""
    try:
        return name.encode()
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\udc80" <= c <= "\udcff" else c for c in name).encode(errors="replace")


def _translate(part: str) -> bytes:
    """One glob component as an RE2 pattern over a name's `_text`: `*`, `?` and `[...]` (`[!...]` negated). A range
    whose ends are reversed matches nothing, as in fnmatch: the component may come from a job's name or work
    directory, and must never fail."""
    out, i = [], 0
    while i < len(part):
        ch = part[i]
        i += 1
        if ch == "*":
            out.append(".*")
        elif ch == "?":
            out.append(".")
        elif ch == "[":
            negate = part[i:i + 1] == "!"
            j = i + negate
            j += part[j:j + 1] == "]"  # a `]` first in the set is a member
            end = part.find("]", j)
            if end < 0:
                out.append(re.escape("["))
                continue
            out.append(_char_set(part[i + negate:end], negate))
            i = end + 1
        else:
            out.append(re.escape(ch))
    return _text("(?s)" + "".join(out))


def _char_set(body: str, negate: bool) -> str:
    """A glob set as an RE2 class: its characters and ranges escaped, reversed ranges dropped."""
    members, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:
                members.append(f"{re.escape(body[k])}-{re.escape(body[k + 2])}")
            k += 3
        else:
            members.append(re.escape(body[k]))
            k += 1
    if not members:  # nothing in the set: a plain one matches no name, a negated one any character
        return "." if negate else "[^\\x00-\\x{10ffff}]"
    return "[" + ("^" if negate else "") + "".join(members) + "]"


class _Walk:
    def __init__(self, identity: Identity, examine: int, deadline: Deadline) -> None:
        self.identity = identity
        self.examine = examine
        self.deadline = deadline
        self.examined = 0
        self.cut = False

    def count(self) -> bool:
        """Count one entry examined; False once the cap is reached (the walk stops)."""
        if self.examined >= self.examine:
            self.cut = True
            return False
        self.examined += 1
        self.deadline.check()  # each entry: a matching one costs a stat, which a slow mount makes slow
        return True

    def entries(self, directory: str, part: str) -> Iterator[os.DirEntry[str]]:
        """The entries of `directory` whose names match the glob `part`, listed as the job's user may list it."""
        if self.cut:  # the cap is reached: no more directories opened either
            return
        self.deadline.check()
        try:
            fd, st = resolve(self.identity, directory, follow_final=True)
        except OSError:
            return
        try:
            if not stat.S_ISDIR(st.st_mode) or not self.identity.may(st, R_OK | X_OK):
                return
            # The O_PATH descriptor names the checked directory; reopened through /proc it cannot be another.
            listing = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        finally:
            os.close(fd)
        pattern: Pattern = linear(_translate(part))
        dots = part.startswith(".")
        try:
            with os.scandir(listing) as it:
                for entry in it:
                    if not self.count():
                        return
                    name = entry.name
                    if (dots or not name.startswith(".")) and pattern.fullmatch(_text(name)):
                        yield entry
        except OSError:  # a directory that fails while listed (EIO) ends its listing
            return
        finally:
            os.close(listing)

    def stat(self, directory: str, entry: os.DirEntry[str]) -> os.stat_result | None:
        """The entry's stat, a symlink followed with the user's authority; None when it fails."""
        try:
            if entry.is_symlink():
                return stat_as(self.identity, _join(directory, entry.name))
            return entry.stat(follow_symlinks=False)
        except OSError:
            return None


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def newest_as(identity: Identity, pattern: str, keep: int, examine: int, deadline: Deadline = NO_DEADLINE) -> Matches:
    """The newest `keep` regular files matching the absolute glob `pattern`, as `identity` may list and stat them,
    examining at most `examine` directory entries; `deadline` is checked at each (OverBudgetError)."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not pattern.startswith("/") or "\0" in pattern:
        return Matches((), 0, 0, False)
    walk = _Walk(identity, examine, deadline)
    dirs = ["/"]
    for part in parts[:-1]:  # the directories the pattern goes through
        if not glob.has_magic(part):
            dirs = [_join(d, part) for d in dirs]
            continue
        found = []
        for d in dirs:
            for entry in walk.entries(d, part):
                st = walk.stat(d, entry)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    found.append(_join(d, entry.name))
        dirs = found
    newest: list[tuple[float, str]] = []
    matched = 0
    last = parts[-1] if parts else ""
    for d in dirs:
        candidates: Iterator[tuple[str, os.stat_result | None]]
        if glob.has_magic(last):
            candidates = ((_join(d, e.name), walk.stat(d, e)) for e in walk.entries(d, last))
        else:
            candidates = ((path, _stat(identity, path)) for path in [_join(d, last)] if walk.count())
        for path, st in candidates:
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            matched += 1
            if len(newest) < keep:
                heapq.heappush(newest, (st.st_mtime, path))
            elif newest and (st.st_mtime, path) > newest[0]:
                heapq.heapreplace(newest, (st.st_mtime, path))
    return Matches(tuple(sorted(path for _, path in newest)), matched, walk.examined, walk.cut)


def _stat(identity: Identity, path: str) -> os.stat_result | None:
    try:
        return stat_as(identity, path)
    except OSError:
        return None
