"""The exchange: one folder that every student's server and the instructor's share, through which students
hand in notebooks and get their feedback pages back (nbgrader's exchange, reduced to two folders).

    inbound/<user>/<exercise id>/<UTC time>.ipynb    `labkit submit`: one file per submission, never replaced
    feedback/<user>/<exercise id>.feedback.md        `labkit feedback --return`: the page of the one that counted

On Zero to JupyterHub the exchange is a volume mounted at /srv/exchange in every user pod, where each
student's home is a volume of its own that nobody else mounts. The student is $JUPYTERHUB_USER. Who may
read what is decided by the mounts, not by these files' modes (docs/instructor.md, "Collect and return").
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

EXCHANGE_ENV = "LABKIT_EXCHANGE"  # overrides DEFAULT_EXCHANGE (tests, or a hub that mounts it elsewhere)
DEFAULT_EXCHANGE = Path("/srv/exchange")
USER_ENV = "JUPYTERHUB_USER"  # JupyterHub sets it in every single-user server
INBOUND, FEEDBACK = "inbound", "feedback"
FEEDBACK_SUFFIX = ".feedback.md"
STAMP_FORMAT = "%Y%m%dT%H%M%S.%fZ"  # sorts as it reads: the file name is the submission's time
PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600
_USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}")  # one path component, never '..' or hidden
_EXERCISE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class Submission:
    """One handed-in notebook in the exchange: whose, which exercise, where, and when (UTC)."""

    user: str
    exercise: str
    path: Path
    submitted_at: datetime

    @property
    def timestamp(self) -> float:
        """Seconds since the epoch, for the collected copy's modification time."""
        return self.submitted_at.timestamp()


@dataclass(frozen=True)
class Collected:
    """A student's submission copied out of the exchange to be graded: the latest of `attempts`."""

    user: str
    file: Path
    latest: Submission
    attempts: int


def exchange_root(given: str | os.PathLike | None = None) -> Path:
    """The exchange folder: `given`, else $LABKIT_EXCHANGE, else /srv/exchange."""
    return Path(given or os.environ.get(EXCHANGE_ENV) or DEFAULT_EXCHANGE)


def check_user(name: str, where: str = "the user name") -> str:
    """`name` when it can name a folder of the exchange (one path component, not hidden); ValueError if not."""
    if not _USER_NAME.fullmatch(name or ""):
        raise ValueError(
            f"{where} {name!r} cannot name an exchange folder; use letters, digits and . _ @ + - only"
        )
    return name


def current_user(given: str | None = None) -> str:
    """The student: `given`, else $JUPYTERHUB_USER (set by JupyterHub in every server); ValueError if none."""
    name = given or os.environ.get(USER_ENV, "")
    if not name:
        raise ValueError(
            f"${USER_ENV} is not set, so whose submission this is is unknown; run this in your hub server's "
            "terminal (or pass --user NAME)"
        )
    return check_user(name, f"${USER_ENV}" if not given else "--user")


def notebook_exercise(notebook: Path) -> str:
    """The exercise id of `notebook` (metadata.labkit.exercise); ValueError when it is not a labkit exercise."""
    try:
        nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise ValueError(
            f"{notebook} is not a readable notebook ({why}); pass your exercise's .ipynb"
        ) from None
    meta = nb.get("metadata", {}).get("labkit", {}) if isinstance(nb, dict) else {}
    value = meta.get("exercise") if isinstance(meta, dict) else None
    if not isinstance(value, str) or not _EXERCISE_ID.fullmatch(value):
        raise ValueError(
            f"{notebook} has no metadata.labkit.exercise: it is not one of the course's exercises; "
            "pass the notebook from exercises/ you filled in"
        )
    return value


def _private_folder(folder: Path, shared: Path) -> None:
    """Make `shared` (inbound/ or feedback/, the umask's mode: every student's folder is in it) and `folder`
    under it, with the missing folders between them, with mode 0700."""
    shared.mkdir(exist_ok=True)
    missing = []
    while not folder.exists() and folder != shared:
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(mode=PRIVATE_FOLDER, exist_ok=True)
        os.chmod(path, PRIVATE_FOLDER)  # mkdir's mode is filtered by the umask


def _writable_exchange(root: Path, folder: Path) -> None:
    """ValueError, in a sentence, when the exchange is not there or this user may not write `folder` in it."""
    if not root.is_dir():
        raise ValueError(
            f"the exchange {root} does not exist on this server; ask your instructor (the hub must mount "
            f"the exchange volume there), or pass --exchange DIR or set ${EXCHANGE_ENV}"
        )
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"this server may not write {folder} (it stops at {existing}): the exchange has no folder of "
            "yours; ask your instructor to check the exchange volume's mounts"
        )


def submit(notebook: Path, root: Path, user: str, now: datetime | None = None) -> Submission:
    """Copy `notebook` into inbound/<user>/<exercise>/<UTC time>.ipynb (folders 0700, file 0600, its
    modification time the submission's). The copy appears whole or not at all: written beside, then renamed."""
    exercise = notebook_exercise(notebook)
    folder = root / INBOUND / check_user(user) / exercise
    _writable_exchange(root, folder)
    _private_folder(folder, root / INBOUND)
    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    target = folder / f"{when.strftime(STAMP_FORMAT)}.ipynb"
    partial = folder / f".{target.name}.part"  # hidden: a collection running meanwhile never sees it
    shutil.copyfile(notebook, partial)
    os.chmod(partial, PRIVATE_FILE)
    os.utime(partial, (when.timestamp(), when.timestamp()))
    os.replace(partial, target)
    return Submission(user, exercise, target, when)


def _parse_stamp(name: str) -> datetime | None:
    try:
        return datetime.strptime(name.removesuffix(".ipynb"), STAMP_FORMAT).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def submissions(root: Path, exercise: str) -> dict[str, list[Submission]]:
    """{user: their submissions of `exercise`, oldest first}, from inbound/*/<exercise>/. Files whose name is
    not a submission time (a student's own copy, a partial write) are not submissions."""
    found: dict[str, list[Submission]] = {}
    for path in sorted((root / INBOUND).glob(f"*/{exercise}/*.ipynb")):
        user = path.parent.parent.name
        when = _parse_stamp(path.name)
        if when is None or not _USER_NAME.fullmatch(user):
            continue
        found.setdefault(user, []).append(Submission(user, exercise, path, when))
    return {user: sorted(subs, key=lambda s: s.submitted_at) for user, subs in sorted(found.items())}


def collect(root: Path, exercise: str, dest: Path) -> list[Collected]:
    """Copy each student's latest submission of `exercise` to dest/<user>.ipynb, its modification time the
    submission's (the gradebook's submitted_at and late read it). Earlier submissions stay in the exchange."""
    dest.mkdir(parents=True, exist_ok=True)
    collected = []
    for user, theirs in submissions(root, exercise).items():
        latest = theirs[-1]
        target = dest / f"{user}.ipynb"
        shutil.copyfile(latest.path, target)
        os.utime(target, (latest.timestamp, latest.timestamp))
        collected.append(Collected(user, target, latest, len(theirs)))
    return collected


def return_feedback(root: Path, user: str, exercise: str, page: Path) -> Path:
    """Write `page` to feedback/<user>/<exercise>.feedback.md (folder 0700, file 0600), replacing an older one."""
    folder = root / FEEDBACK / check_user(user, "the gradebook's student")
    _private_folder(folder, root / FEEDBACK)
    target = folder / f"{exercise}{FEEDBACK_SUFFIX}"
    partial = folder / f".{target.name}.part"
    shutil.copyfile(page, partial)
    os.chmod(partial, PRIVATE_FILE)
    os.replace(partial, target)
    return target


def feedback_pages(root: Path, user: str) -> list[Path]:
    """The feedback pages returned to `user`, by exercise id."""
    return sorted((root / FEEDBACK / check_user(user)).glob(f"*{FEEDBACK_SUFFIX}"))
