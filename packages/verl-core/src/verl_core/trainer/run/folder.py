"""The output folder of a run: one run per folder, and a run deletes only what it created.

A fresh run claims its ``output_dir`` by writing the run marker ``verl_run.json`` (run id, config
hash, the verl-core that created it and when) before anything else lands there; ``--resume``
continues only a folder holding a marker. Everything the trainer later deletes (its replay-buffer
spill files, a half-built tiny model, checkpoint temporaries and pruned checkpoints) lies inside a
folder it claimed, so it never removes files of another run or of the user.

Refused with a :class:`~verl_core.kernel.errors.ConfigError` that names the folder, what was found there
and the ways out, before any engine is built:

* an empty ``output_dir``, the filesystem root, the home directory, the current directory or a
  folder holding one of them (in every mode, ``overwrite`` included);
* a fresh run in a folder that holds a run (its marker, or checkpoints without one) or anything
  else: a fresh run starts only in a new or empty folder;
* ``--resume`` in a folder without a marker;
* any run in a folder that another process is running in (a running run keeps its marker locked).

``overwrite=true`` moves what the folder holds aside to ``<output_dir>.old-<time>`` and starts a
fresh run; nothing is deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Final, Literal

from verl_core.enginekit.checkpoint import fsync_dir
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.version import __version__
from verl_core.trainer.config import RunConfig, config_to_dict

try:
    import fcntl

    _LOCKS = True
except ImportError:  # pragma: no cover - no advisory locks (Windows): the marker alone keeps runs apart
    _LOCKS = False

__all__ = ["MARKER_FILE", "Mode", "RunDir", "RunMarker", "config_hash", "no_checkpoint_ways_out", "read_marker"]

MARKER_FILE: Final = "verl_run.json"
_FORMAT: Final = "verl.run/1"
_TMP_PREFIX: Final = f".{MARKER_FILE}."  # a marker being written: .verl_run.json.<hex>.tmp
_NOT_HASHED: Final = ("output_dir", "overwrite")  # where and how a run starts is not what it trains

Mode = Literal["fresh", "resume", "any"]

# Claims held by this process, so a refusal can say that the holder is an unclosed Trainer here.
_HELD: weakref.WeakValueDictionary[str, RunDir] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class RunMarker:
    """What ``verl_run.json`` records about the run that owns a folder.

    Attributes:
        run_id: A random UUID (32 hex digits) naming the run.
        config_hash: SHA-256 of the run's config, ``output_dir`` and ``overwrite`` left out.
        created_by: ``verl-core <version>`` that started the run.
        created: When the run started (UTC, ISO 8601).
    """

    run_id: str
    config_hash: str
    created_by: str
    created: str


def config_hash(config: RunConfig) -> str:
    """SHA-256 of ``config`` as canonical JSON, without ``output_dir`` and ``overwrite``."""
    data = {k: v for k, v in config_to_dict(config).items() if k not in _NOT_HASHED}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def read_marker(output_dir: str | os.PathLike[str]) -> RunMarker | None:
    """The marker of the run in ``output_dir`` (None when the folder holds no marker).

    Raises:
        ConfigError: the marker exists but is not a readable ``verl_run.json``.
    """
    path = Path(output_dir) / MARKER_FILE
    if not path.exists():
        return None
    try:
        return _read_marker(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"run marker {str(path)!r} cannot be read ({e})") from e


def _read_marker(path: Path) -> RunMarker:
    data = json.loads(path.read_text())
    fields = [f.name for f in dataclasses.fields(RunMarker)]
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"not a {_FORMAT} marker")
    values: dict[str, str] = {}
    for k in fields:
        v = data.get(k)
        if not isinstance(v, str) or not v:
            raise ValueError(f"field {k!r} is missing or not a string")
        values[k] = v
    return RunMarker(**values)


class RunDir:
    """An output folder claimed by one run; get one with :meth:`claim`.

    While claimed, the marker is locked (``flock``) so no other process starts, resumes or
    overwrites the run; :meth:`release` (called by ``Trainer.close``) lets it go, and the lock
    also ends with the process.

    Attributes:
        path: The output folder, as configured.
        marker: The marker of the run that owns it.
        created: True when this claim started the run (wrote the marker); False when it opened a
            run that was there.
        moved_aside: Where ``overwrite`` moved the folder's earlier contents (None: nothing moved).
    """

    def __init__(
        self, path: Path, marker: RunMarker, *, created: bool, lock: IO[bytes] | None, moved_aside: Path | None,
        made_folder: bool = False,
    ) -> None:
        self.path = path
        self.marker = marker
        self.created = created
        self.moved_aside = moved_aside
        self._made_folder = made_folder
        self._lock = lock
        _HELD[_key(path)] = self

    # ------------------------------------------------------------------ claiming
    @classmethod
    def claim(cls, output_dir: str, config: RunConfig, *, mode: Mode) -> RunDir:
        """Claim ``output_dir`` for a run of ``config``; writes nothing but the marker (and a move aside).

        Args:
            output_dir: The run's folder.
            config: The run (``config.overwrite`` allows moving the folder's contents aside).
            mode: ``fresh`` starts a run (the folder must be new or empty, or ``overwrite`` set);
                ``resume`` opens the run the folder holds (its marker must be there); ``any`` opens
                the run when there is one (and ``overwrite`` is off), else starts one.

        Raises:
            ConfigError: the folder may not be used so; the message names the folder, what it
                holds and the ways out.
        """
        path = _check_location(output_dir)
        try:
            found = _survey(path)
        except OSError as e:
            raise ConfigError(f"output_dir {str(path)!r} cannot be read ({e}); choose another output_dir") from e
        if mode == "resume" and config.overwrite:
            raise ConfigError(
                f"--resume continues the run in {str(path)!r}, but overwrite=true starts a fresh one (moving "
                "that run aside); drop one of the two"
            )
        if mode == "resume" or (mode == "any" and found.kind == "run" and not config.overwrite):
            return cls._open(path, found)
        return cls._start(path, found, config)

    @classmethod
    def _start(cls, path: Path, found: _Found, config: RunConfig) -> RunDir:
        moved = None
        if found.kind != "empty":
            if not config.overwrite:
                if found.kind == "run" and not _checkpoints(path):
                    _lock_marker(path).close()  # a run still under way before its first checkpoint is said so
                detail = _describe(path, found, config)
                raise ConfigError(
                    f"output_dir {str(path)!r} {detail}; a fresh run starts only in a new or empty folder "
                    f"(so two runs never mix): {_ways_out(path, run=found.kind == 'run')}"
                )
            moved = _move_aside(path, found)
        made = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"output_dir {str(path)!r} cannot be created ({e}); choose another output_dir") from e
        marker = RunMarker(
            run_id=uuid.uuid4().hex,
            config_hash=config_hash(config),
            created_by=f"verl-core {__version__}",
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        lock = _write_marker(path, marker)
        return cls(path, marker, created=True, lock=lock, moved_aside=moved, made_folder=made)

    @classmethod
    def _open(cls, path: Path, found: _Found) -> RunDir:
        if found.kind == "run":
            assert found.marker is not None
            return cls(path, found.marker, created=False, lock=_lock_marker(path), moved_aside=None)
        fresh = "run without --resume to start a fresh run there"
        if found.kind == "empty":
            why = "holds no run (there is nothing to resume)"
        elif found.kind == "checkpoints":
            why = (
                f"holds checkpoints but no run marker {MARKER_FILE} (written by an older verl-core, or the "
                "marker was removed), so it cannot be told apart from another run's folder"
            )
            fresh = (
                f"start a fresh run in another output_dir, or without --resume with overwrite=true (moves "
                f"this folder aside to {_aside_hint(path)})"
            )
        else:
            why = found.detail
            fresh = f"choose another output_dir (or {fresh} with overwrite=true, which moves it aside)"
        raise ConfigError(f"--resume: output_dir {str(path)!r} {why}; --resume needs a folder holding a run: {fresh}")

    # ------------------------------------------------------------------ while the run goes on
    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.marker.run_id

    @property
    def spill_root(self) -> Path:
        """The folder of this run's replay-buffer spill files (named by the run id)."""
        return self.path / f"spill-{self.marker.run_id}"

    @property
    def model_tmp(self) -> Path:
        """Where this run builds its tiny model before renaming it into place."""
        return self.path / f".model-tmp-{self.marker.run_id}"

    @property
    def held(self) -> bool:
        """Whether this claim is held (not yet released)."""
        return self._lock is not None

    def check_owned(self) -> None:
        """Check that the folder still holds this run's marker.

        Raises:
            ConfigError: the marker is gone or names another run (the folder was moved or
                replaced while the run held it).
        """
        try:
            now: RunMarker | None = _read_marker(self.path / MARKER_FILE)
        except (OSError, ValueError):
            now = None
        if now is None or now.run_id != self.run_id:
            raise ConfigError(
                f"output_dir {str(self.path)!r} no longer holds this run's marker (run {self.run_id}): the folder "
                "was moved, removed or replaced while the run held it; stopping so two runs never mix. Look for "
                "the run where it was moved, or start a fresh run"
            )

    def require_fresh(self, config: RunConfig) -> None:
        """Check that this claim started the run (a fresh run never continues a run it found).

        Raises:
            ConfigError: the run was there before (the folder was opened, not started).
        """
        if not self.created:
            found = _Found("run", self.marker)
            raise ConfigError(
                f"output_dir {str(self.path)!r} {_describe(self.path, found, config)}; a fresh run starts only "
                f"in a new or empty folder (so two runs never mix): {_ways_out(self.path, run=True)}"
            )

    def acquire(self) -> None:
        """Claim the folder again after :meth:`release` (the run must still be there).

        Raises:
            ConfigError: another process runs there, or the folder no longer holds this run.
        """
        if self._lock is None:
            self._lock = _lock_marker(self.path)
            _HELD[_key(self.path)] = self
        self.check_owned()

    def abandon(self, written: tuple[str, ...] = ()) -> bool:
        """Give the folder back after the run's setup failed, before it trained or saved anything.

        Where this claim started the run (:attr:`created`), the marker goes, with the entries of
        ``written`` (names in the folder the run wrote during its setup, such as its tiny ``model``),
        and the folder itself when this claim made it and nothing else is in it; so the same
        ``output_dir`` takes the corrected run. Anything else stays: a folder holding a checkpoint is
        left whole, and a claim that opened a run that was there (``created`` False) is only released.
        What ``overwrite`` moved aside stays where it was moved. Returns whether the marker was removed.
        """
        gone = False
        if self.created and not _checkpoints(self.path):
            for name in written:
                entry = self.path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                elif entry.exists() or entry.is_symlink():
                    entry.unlink(missing_ok=True)
            now = None
            with contextlib.suppress(OSError, ValueError):
                now = _read_marker(self.path / MARKER_FILE)
            if now is not None and now.run_id == self.run_id:
                (self.path / MARKER_FILE).unlink(missing_ok=True)
                gone = True
        self.release()
        if gone and self._made_folder:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only when empty
        return gone

    def release(self) -> None:
        """Let the folder go (another process may then resume or overwrite the run)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if _HELD.get(_key(self.path)) is self:
            del _HELD[_key(self.path)]


# ---------------------------------------------------------------------------- what a folder holds
@dataclass(frozen=True)
class _Found:
    kind: Literal["empty", "run", "damaged", "checkpoints", "other"]
    marker: RunMarker | None = None
    detail: str = ""


def _key(path: Path) -> str:
    return str(path.resolve())


def _check_location(output_dir: str) -> Path:
    """``output_dir`` as a Path, refusing places a run must never write, move or prune in."""
    fix = "name a folder of the run's own, e.g. output_dir=runs/NAME"
    text = str(output_dir)
    if not text.strip():
        raise ConfigError(
            f"config key 'output_dir' is empty, which would put the run's files into the current directory; {fix}"
        )
    path = Path(text)
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"config key 'output_dir' = {text!r} cannot be resolved ({e}); {fix}") from e
    guarded: list[tuple[str, Path]] = [("the filesystem root", Path(resolved.anchor))]
    with contextlib.suppress(OSError, RuntimeError):
        guarded.append(("the current directory", Path.cwd().resolve()))
    with contextlib.suppress(OSError, RuntimeError, KeyError):
        guarded.append(("your home directory", Path.home().resolve()))
    for what, place in guarded:
        if resolved == place or resolved in place.parents:
            how = "is" if resolved == place else "contains"
            raise ConfigError(
                f"config key 'output_dir' = {text!r} {how} {what} ({str(place)!r}); a run writes, moves and prunes "
                f"files in its output_dir, so it never uses such a folder (overwrite=true does not change this): {fix}"
            )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir {text!r} is a file, not a folder; choose another output_dir")
    return path


def _is_marker_tmp(name: str) -> bool:
    return name.startswith(_TMP_PREFIX) and name.endswith(".tmp")


def _checkpoints(path: Path) -> list[str]:
    root = path / "checkpoints"
    return sorted(p.name for p in root.glob("step-*")) if root.is_dir() else []


def _survey(path: Path) -> _Found:
    if not path.exists():
        return _Found("empty")
    names = sorted(p.name for p in path.iterdir() if not _is_marker_tmp(p.name))
    if MARKER_FILE in names:
        try:
            return _Found("run", _read_marker(path / MARKER_FILE))
        except (OSError, ValueError) as e:
            return _Found("damaged", detail=f"holds a run marker {MARKER_FILE} that cannot be read ({e})")
    if _checkpoints(path):
        return _Found(
            "checkpoints",
            detail=f"holds checkpoints ({', '.join(_checkpoints(path)[-2:])}) but no run marker {MARKER_FILE}",
        )
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return _Found("other", detail=f"is not empty (it holds {shown}) and is not a verl run (no {MARKER_FILE})")
    return _Found("empty")


def _describe(path: Path, found: _Found, config: RunConfig) -> str:
    if found.kind != "run":
        return found.detail
    m = found.marker
    assert m is not None
    same = "the same config as this one" if m.config_hash == config_hash(config) else "a different config"
    done = _checkpoints(path)
    about = f"run {m.run_id}, started {m.created} by {m.created_by}, {same}"
    if not done:
        return f"already holds a run that never reached a checkpoint ({about}), so there is nothing to resume"
    return f"already holds a run ({about}, checkpoints up to {done[-1]})"


def _aside_hint(path: Path) -> str:
    return repr(f"{path}.old-<time>")


def _ways_out(path: Path, *, run: bool) -> str:
    """The ways out of a folder a fresh run may not start in; ``run``: the folder holds a run's marker.

    ``--resume`` is offered only where there is a checkpoint to continue from; a run that never
    reached one can only be started again elsewhere, or in its folder once that is emptied.
    """
    resumable = run and bool(_checkpoints(path))
    ways = ["continue that run with `verl train CONFIG --resume` (Trainer.train(resume=True))"] if resumable else []
    ways.append("choose another output_dir")
    if run and not resumable:
        ways.append(f"remove {str(path)!r} if it is yours")
    ways.append(f"set overwrite=true to move what it holds aside to {_aside_hint(path)} and start fresh (nothing is deleted)")
    return "; or ".join(ways)


def no_checkpoint_ways_out(path: str | os.PathLike[str]) -> str:
    """The ways out for ``--resume`` in a folder whose run never reached a checkpoint."""
    return _ways_out(Path(path), run=True)


# ---------------------------------------------------------------------------- marker and lock
def _flock(fh: IO[bytes]) -> bool:
    """Lock ``fh`` exclusively without waiting; False when another open file holds the lock."""
    if not _LOCKS:  # pragma: no cover
        return True
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_marker(path: Path) -> IO[bytes]:
    """Open and lock the marker of the run in ``path``; refuse when a process is running there."""
    marker = path / MARKER_FILE
    try:
        fh = open(marker, "rb")  # noqa: SIM115 - held open for as long as the claim
    except OSError as e:
        raise ConfigError(f"output_dir {str(path)!r}: its run marker cannot be opened ({e})") from e
    if _flock(fh):
        return fh
    fh.close()
    holder = _HELD.get(_key(path))
    who = (
        "a Trainer in this process that was not closed holds it (call its close(), or use `with Trainer(...)`)"
        if holder is not None and holder._lock is not None
        else "another process is running that run now"
    )
    raise ConfigError(
        f"output_dir {str(path)!r} is in use: {who}; wait for it to finish, or choose another output_dir"
    )


def _write_marker(path: Path, marker: RunMarker) -> IO[bytes]:
    """Write the marker atomically and exclusively, already locked; refuse when another run got there first."""
    data = json.dumps({"format": _FORMAT, **dataclasses.asdict(marker)}, indent=1).encode()
    dest = path / MARKER_FILE
    tmp = path / f"{_TMP_PREFIX}{uuid.uuid4().hex}.tmp"
    try:
        fh: IO[bytes] = open(tmp, "x+b")  # noqa: SIM115 - its lock is the claim
    except OSError as e:  # a folder this user cannot write, a read-only or full filesystem
        raise ConfigError(
            f"output_dir {str(path)!r} cannot be written ({type(e).__name__}: {e}); choose a folder you can write"
        ) from e
    try:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
        _flock(fh)  # a new file: nobody else can hold it
        try:
            os.link(tmp, dest)  # appears complete and locked, and only when no marker is there
        except FileExistsError:
            raise ConfigError(
                f"output_dir {str(path)!r}: another run started there at the same moment (its {MARKER_FILE} "
                "appeared while this one was being written); choose another output_dir, or wait and use --resume"
            ) from None
        except OSError:  # pragma: no cover - a filesystem without hard links: create exclusively instead
            fh.close()
            fh = _write_exclusive(dest, data, path)
    except BaseException:
        fh.close()
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path)
    return fh


def _write_exclusive(dest: Path, data: bytes, path: Path) -> IO[bytes]:  # pragma: no cover
    try:
        fh = open(dest, "x+b")  # noqa: SIM115
    except FileExistsError:
        raise ConfigError(
            f"output_dir {str(path)!r}: another run started there at the same moment; choose another output_dir"
        ) from None
    _flock(fh)
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())
    return fh


def _move_aside(path: Path, found: _Found) -> Path:
    """Rename ``path`` to ``<path>.old-<time>`` (``overwrite``); a run in progress there is refused."""
    lock = _lock_marker(path) if found.kind == "run" else None
    try:
        here = Path(os.path.abspath(path))  # a symlink is moved itself, not the folder it points to
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = here.with_name(f"{here.name}.old-{stamp}")
        n = 1
        while aside.exists():
            aside = here.with_name(f"{here.name}.old-{stamp}-{n}")
            n += 1
        try:
            os.rename(here, aside)
        except OSError as e:
            raise ConfigError(
                f"overwrite=true: cannot move output_dir {str(path)!r} aside to {str(aside)!r} ({e}); move it "
                "yourself or choose another output_dir"
            ) from e
        fsync_dir(here.parent)
        return aside
    finally:
        if lock is not None:
            lock.close()

