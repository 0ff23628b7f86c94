"""Where a run's metrics go: JSON lines (the default), TensorBoard, Weights & Biases, user callbacks.

:class:`MetricSinks` is the one object the trainer talks to. It is opened once per run from a
:class:`SinkConfig` (config key ``logging.sinks``) and fans every step's metrics out to the sinks
listed there, in this order: ``jsonl``, ``tensorboard``, ``wandb``, then callbacks in the order
given. Each entry of ``logging.sinks`` is one of

* ``"jsonl"``: one JSON object per step appended to ``<output_dir>/metrics.jsonl``;
* ``"tensorboard"``: scalars through ``torch.utils.tensorboard`` (extra ``verl-core[tensorboard]``);
* ``"wandb"``: a Weights & Biases run, offline by default (extra ``verl-core[wandb]``);
* ``"package.module:attr"`` or ``"path/to/file.py:attr"``: a callback object, a class, or a
  factory taking no arguments that returns one (see :class:`RunCallback`).

TensorBoard and W&B get only the numeric metrics (a value such as ``"not comparable"`` stays in
the JSON lines). A resumed run continues the same logs: the JSON lines of steps after the
checkpoint are dropped, TensorBoard hides the events after it, and W&B continues the same run id.

Messages go to the ``verl_core.trainer.sinks`` logger; :class:`ProgressBar` is the step bar (tqdm).
"""

from __future__ import annotations

import importlib
import json
import logging
import numbers
import os
import sys
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Final, Literal, Protocol

from verl_core.enginekit.checkpoint import write_atomic
from verl_core.kernel.convert import Check, check_fields
from verl_core.kernel.errors import ConfigError, StorageError, VerlError
from verl_core.trainer.inputs.usercode import import_object, split_spec

__all__ = [
    "BUILTIN_SINKS",
    "METRICS_FILE",
    "CallbackError",
    "MetricSinks",
    "ProgressBar",
    "RunCallback",
    "SinkConfig",
    "check_sinks",
    "load_callback",
    "read_json_lines",
    "truncate_metrics",
    "write_text_atomic",
]

logger = logging.getLogger("verl_core.trainer.sinks")

METRICS_FILE: Final = "metrics.jsonl"
BUILTIN_SINKS: Final = ("jsonl", "tensorboard", "wandb")
WANDB_ID_FILE: Final = "wandb_run_id"
HOOKS: Final = ("on_step_end", "on_eval", "on_checkpoint")
EVAL_PREFIX: Final = "eval/"

WandbMode = Literal["offline", "online", "disabled"]

_CHOICES: Final = (
    "'jsonl', 'tensorboard', 'wandb', or a callback as 'package.module:attr' or 'path/to/file.py:attr'"
)


@dataclass(frozen=True)
class SinkConfig:
    """Which sinks a run's metrics go to, and their settings: the one declaration of the
    ``logging.sinks``, ``logging.wandb_*`` and ``logging.tensorboard_dir`` keys (the run config's
    ``logging`` section, :class:`~verl_core.trainer.config.LoggingConfig`, is a SinkConfig).

    Attributes:
        sinks: The sinks, in any order: ``jsonl``, ``tensorboard``, ``wandb``, and callbacks named
            ``package.module:attr`` or ``path/to/file.py:attr``. A list is accepted and kept as a tuple.
        wandb_project: The W&B project of the run.
        wandb_mode: ``offline`` (the default: files under ``<output_dir>/wandb``, upload later with
            ``wandb sync``; needs no network or account), ``online``, or ``disabled``.
        tensorboard_dir: Folder of the TensorBoard event files; empty = ``<output_dir>/tensorboard``.

    Raises:
        ConfigError: an entry that is neither a built-in sink nor a callback spec, a repeated entry,
            an unknown W&B mode or an empty W&B project.
    """

    sinks: tuple[str, ...] = ("jsonl",)
    wandb_project: Annotated[str, Check(bool, "a non-empty W&B project name")] = "verl"
    wandb_mode: WandbMode = "offline"
    tensorboard_dir: str = ""

    def __post_init__(self) -> None:
        given: object = self.sinks  # a list or a bare string from a config file
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise ConfigError(
                f"config key 'logging.sinks': expected a list of sink names, got {self.sinks!r}; "
                f"each entry is {_CHOICES}"
            )
        check_fields(self, prefix="logging.")  # types, the W&B modes and a named project, from the fields
        seen: set[str] = set()
        for entry in self.sinks:
            if not (entry in BUILTIN_SINKS or _is_callback_spec(entry)):
                raise ConfigError(f"config key 'logging.sinks': unknown sink {entry!r}; choices: {_CHOICES}")
            if entry in seen:
                raise ConfigError(f"config key 'logging.sinks': {entry!r} is listed twice; list each sink once")
            seen.add(entry)

    @property
    def callbacks(self) -> tuple[str, ...]:
        """The callback specs among :attr:`sinks`, in order."""
        return tuple(s for s in self.sinks if s not in BUILTIN_SINKS)


def _is_callback_spec(entry: str) -> bool:
    try:
        split_spec(entry, "callback")
    except ConfigError:
        return False
    return True


class RunCallback(Protocol):
    """What a callback listed in ``logging.sinks`` may implement; every hook is optional.

    A callback implements any subset of the three hooks (the trainer calls only those present)
    and needs no base class; a class that inherits from ``RunCallback`` explicitly gets no-op
    defaults for the hooks it leaves out. Hooks run in the training process, after the built-in
    sinks have written the same step, and should return quickly.

    A hook that raises fails the run: the error is re-raised as :class:`CallbackError` naming the
    callback, the hook and the step (a callback that must never stop training catches its own
    errors). The metrics passed in are a read-only view.
    """

    def on_step_end(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Called after training step ``step`` (1-based) with all its metrics, ``eval/*`` included."""
        return None

    def on_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Called after an evaluation at step ``step`` with its ``eval/*`` metrics."""
        return None

    def on_checkpoint(self, step: int, path: Path) -> None:
        """Called once the checkpoint of step ``step`` is complete on disk at ``path``."""
        return None


class CallbackError(VerlError, RuntimeError):
    """A callback listed in ``logging.sinks`` raised in one of its hooks; the run stops.

    Attributes:
        callback: The callback as listed in ``logging.sinks`` (or its class name).
        hook: The hook that raised (``on_step_end``, ``on_eval`` or ``on_checkpoint``).
        step: The step the hook was called for.
    """

    def __init__(self, callback: str, hook: str, step: int, error: BaseException) -> None:
        super().__init__(
            f"callback {callback!r} raised in {hook} at step {step}: {type(error).__name__}: {error}. "
            "Fix the callback or remove it from config key 'logging.sinks'; the metrics of this step "
            "were already written by the other sinks"
        )
        self.callback = callback
        self.hook = hook
        self.step = step


# ---------------------------------------------------------------------------- JSON lines files
def read_json_lines(path: Path) -> list[str]:
    """The complete JSON lines of a log file (a run killed mid-write leaves a torn last line)."""
    out = []
    for ln in path.read_text(errors="replace").splitlines():
        try:
            json.loads(ln)
        except ValueError:
            continue
        out.append(ln)
    return out


write_text_atomic = write_atomic  # the name the run loops import


def truncate_metrics(path: str | os.PathLike[str], step: int) -> list[dict[str, Any]]:
    """Keep the metric lines of steps up to ``step`` (a checkpoint's) and return them parsed.

    Torn lines are dropped too. A missing file is left missing and gives an empty list.
    """
    p = Path(path)
    if not p.is_file():
        return []
    kept = [ln for ln in read_json_lines(p) if json.loads(ln)["step"] <= step]
    write_atomic(p, "".join(ln + "\n" for ln in kept))
    return [json.loads(ln) for ln in kept]


# ---------------------------------------------------------------------------- sinks
class _Sink(Protocol):
    name: str

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: Literal["step", "eval"]) -> None: ...

    def checkpoint(self, step: int, path: Path) -> None: ...

    def close(self, *, failed: bool) -> None: ...


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics (bools as 0/1), without ``step`` (the x axis)."""
    out = {}
    for k, v in metrics.items():
        if k != "step" and isinstance(v, numbers.Real):
            out[k] = float(v)
    return out


def _require(module: str, package: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"config key 'logging.sinks' lists {extra!r}, which needs {package}: "
            f"pip install 'verl-core[{extra}]' (import failed: {e})"
        ) from e


def _tensorboard_dir(output_dir: Path, config: SinkConfig) -> tuple[Path, str]:
    """The TensorBoard folder and the config key that sets it."""
    if config.tensorboard_dir:
        return Path(config.tensorboard_dir), "logging.tensorboard_dir"
    return output_dir / "tensorboard", "output_dir"


def _check_folder(path: Path, key: str) -> None:
    """Refuse a folder that cannot be created or written (a file in its place or above it, no permission)."""
    for folder in (path, *path.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            where = "is a file, not a folder" if folder == path else f"lies under {str(folder)!r}, which is a file"
            raise ConfigError(
                f"config key {key!r}: the folder {str(path)!r} {where}; name a folder that can be created"
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(
                f"config key {key!r}: the folder {str(path)!r} cannot be created or written: {str(folder)!r} is not "
                "writable by this user; name a folder you can write"
            )
        return


def check_sinks(output_dir: str | os.PathLike[str], config: SinkConfig) -> None:
    """Check what the sinks of ``config`` need before a run writes anything or builds a model.

    The packages of ``tensorboard`` and ``wandb``, and that the TensorBoard folder can be created.
    (:meth:`MetricSinks.open` checks the same when it opens them; callbacks are imported by the
    runners.)

    Raises:
        ConfigError: naming the config key, the package or the folder.
    """
    if "tensorboard" in config.sinks:
        _require("torch.utils.tensorboard", "TensorBoard", "tensorboard")
        _check_folder(*_tensorboard_dir(Path(output_dir), config))
    if "wandb" in config.sinks:
        _require("wandb", "Weights & Biases", "wandb")


class _JsonlSink:
    name = "jsonl"

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        self.history = truncate_metrics(path, resume_step) if resume_step is not None else []
        # append mode: a line is written in one call then flushed, so another process (or a crash)
        # sees whole lines; a torn last line is dropped by read_json_lines
        self._fh: IO[str] = open(path, "a" if resume_step is not None else "w")  # noqa: SIM115

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: Literal["step", "eval"]) -> None:
        line = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        try:
            self._fh.write(json.dumps(line) + "\n")
            self._fh.flush()
        except OSError as e:  # a full disk: the lines before stay whole, and a torn last line is dropped on read
            raise StorageError(
                f"the metrics of step {step} could not be written to {str(self.path)!r}: {e.strerror or e}; the "
                "lines before are kept, and --resume continues from the newest checkpoint once there is space"
            ) from e

    def checkpoint(self, step: int, path: Path) -> None:
        self._fh.flush()

    def close(self, *, failed: bool) -> None:
        try:
            self._fh.close()
        except OSError:  # what a full disk kept in the buffer is lost; the log raised when it happened
            if not failed:
                raise


class _TensorBoardSink:
    name = "tensorboard"

    def __init__(self, logdir: Path, resume_step: int | None) -> None:
        tb = _require("torch.utils.tensorboard", "TensorBoard", "tensorboard")
        # purge_step hides the events at and after it that earlier event files in this folder hold:
        # all of them for a fresh run, those after the checkpoint for a resumed one
        purge = 0 if resume_step is None else resume_step + 1
        self.logdir = logdir
        self._writer = tb.SummaryWriter(log_dir=str(logdir), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: Literal["step", "eval"]) -> None:
        for tag, value in _scalars(metrics).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def checkpoint(self, step: int, path: Path) -> None:
        self._writer.flush()

    def close(self, *, failed: bool) -> None:
        self._writer.close()


class _WandbSink:
    name = "wandb"

    def __init__(
        self, out: Path, config: SinkConfig, run_name: str, resume_step: int | None,
        hparams: Mapping[str, Any] | None,
    ) -> None:
        wandb = _require("wandb", "Weights & Biases", "wandb")
        # the run id is kept beside the metrics so that a resumed run continues the same W&B run
        id_file = out / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            write_atomic(id_file, run_id + "\n")
        try:
            self._run = wandb.init(
                mode=config.wandb_mode, dir=str(out), project=config.wandb_project, name=run_name,
                id=run_id, resume="allow", config=dict(hparams) if hparams else None,
                # the trainer writes its own progress bar; W&B would otherwise wrap stdout and stderr
                settings=wandb.Settings(console="off"),
            )
        except Exception as e:
            raise ConfigError(
                f"W&B could not start run {run_id!r} (config key 'logging.wandb_mode' = "
                f"{config.wandb_mode!r}, project {config.wandb_project!r}): {type(e).__name__}: {e}. "
                "Use wandb_mode 'offline' to log without network, or log in with `wandb login`"
            ) from e
        # the trainer's step is the x axis: W&B's own _step only ever grows, and a resumed run
        # logs steps again after its checkpoint
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self.run_id = run_id

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: Literal["step", "eval"]) -> None:
        self._run.log({**_scalars(metrics), "step": step})

    def checkpoint(self, step: int, path: Path) -> None:
        return None

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class _CallbackSink:
    def __init__(self, obj: object, name: str) -> None:
        self.name = name
        self.hooks: dict[str, Callable[[int, Any], object]] = {}
        for hook in HOOKS:
            fn = getattr(obj, hook, None)
            if callable(fn):
                self.hooks[hook] = fn

    def _call(self, hook: str, step: int, arg: Any) -> None:
        fn = self.hooks.get(hook)
        if fn is None:
            return
        try:
            fn(step, arg)
        except Exception as e:
            raise CallbackError(self.name, hook, step, e) from e

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: Literal["step", "eval"]) -> None:
        if kind == "eval":
            self._call("on_eval", step, types.MappingProxyType(dict(metrics)))
            return
        self._call("on_step_end", step, types.MappingProxyType(dict(metrics)))
        evals = {k: v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
        if evals:  # an evaluation ran in this step
            self._call("on_eval", step, types.MappingProxyType(evals))

    def checkpoint(self, step: int, path: Path) -> None:
        self._call("on_checkpoint", step, path)

    def close(self, *, failed: bool) -> None:
        return None


# ---------------------------------------------------------------------------- callbacks
def _has_hook(obj: object) -> bool:
    return any(callable(getattr(obj, h, None)) for h in HOOKS)


def load_callback(spec: str, *, base_dir: str | os.PathLike[str] | None = None) -> object:
    """Load the callback named ``package.module:attr`` or ``path/to/file.py:attr``.

    ``attr`` (dotted for nested attributes) may be an object with at least one hook of
    :class:`RunCallback`, a class (instantiated with no arguments) or a factory function taking no
    arguments that returns such an object. The spec is resolved by
    :func:`verl_core.trainer.inputs.usercode.import_object` (a target ending in ``.py`` or containing a
    path separator is a file, looked up in ``base_dir`` first, then the working directory).

    Raises:
        ConfigError: the module or file cannot be imported, has no such attribute, the class or
            factory raised, or the object has none of the hooks.
    """
    obj = import_object(spec, what="config key 'logging.sinks': callback", base_dir=base_dir)
    if isinstance(obj, type) or (callable(obj) and not _has_hook(obj)):
        try:
            obj = obj()
        except Exception as e:
            raise ConfigError(
                f"config key 'logging.sinks': calling {spec!r} to build the callback raised "
                f"{type(e).__name__}: {e}; a class or factory listed there must take no arguments"
            ) from e
    if not _has_hook(obj):
        raise ConfigError(
            f"config key 'logging.sinks': callback {spec!r} ({type(obj).__name__}) has none of the hooks "
            f"{', '.join(HOOKS)}; implement at least one (see verl_core.trainer.sinks.RunCallback)"
        )
    return obj


# ---------------------------------------------------------------------------- the facade
class MetricSinks:
    """Every sink of one run behind one object; build it with :meth:`open`.

    Attributes:
        history: The metrics of the steps kept from ``metrics.jsonl`` when a resumed run opened it
            (empty for a fresh run or without the ``jsonl`` sink).
        names: The open sinks, in the order they are called.
    """

    def __init__(self, sinks: Sequence[_Sink], history: list[dict[str, Any]]) -> None:
        self._sinks = list(sinks)
        self.history = history
        self.names = tuple(s.name for s in self._sinks)
        self._closed = False

    @classmethod
    def open(
        cls,
        output_dir: str | os.PathLike[str],
        config: SinkConfig,
        run_name: str,
        resume_step: int | None = None,
        *,
        hparams: Mapping[str, Any] | None = None,
        callbacks: Sequence[object] = (),
        base_dir: str | os.PathLike[str] | None = None,
    ) -> MetricSinks:
        """Open the sinks of ``config`` for a run writing to ``output_dir``.

        Args:
            output_dir: The run's folder (created if missing).
            config: Which sinks, and their settings.
            run_name: The run's display name (the W&B run name).
            resume_step: The checkpoint's step when the run resumes, None for a fresh run. A fresh
                run starts ``metrics.jsonl`` empty; a resumed one keeps its lines up to this step
                (:func:`truncate_metrics`) and continues the W&B run.
            hparams: The run's configuration, recorded as the W&B run config.
            callbacks: Callback objects given in code, called after those of ``config``.
            base_dir: The config file's folder, where relative callback file paths are looked up
                first (then the working directory).

        Raises:
            ConfigError: a sink's package is not installed (naming the pip command), a callback
                cannot be loaded, or W&B cannot start. Nothing is left open then.
        """
        if resume_step is not None and resume_step < 0:
            raise ConfigError(f"resume_step must be >= 0 (a checkpoint's step) or None, got {resume_step}")
        for given in callbacks:
            if not _has_hook(given):
                raise ConfigError(
                    f"callback {given!r} has none of the hooks {', '.join(HOOKS)}; implement at least one"
                )
        # everything that can fail on a missing package or bad spec is checked before any file is
        # written, so a bad config leaves the output folder as it was
        loaded = [(spec, load_callback(spec, base_dir=base_dir)) for spec in config.callbacks]
        out = Path(output_dir)
        check_sinks(out, config)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"config key 'output_dir': {str(out)!r} cannot be created ({type(e).__name__}: {e})") from e
        sinks: list[_Sink] = []
        history: list[dict[str, Any]] = []
        where = "output_dir"
        try:
            if "jsonl" in config.sinks:
                where = f"output_dir (its {METRICS_FILE})"
                jsonl = _JsonlSink(out / METRICS_FILE, resume_step)
                history = jsonl.history
                sinks.append(jsonl)
            if "tensorboard" in config.sinks:
                tb_dir, where = _tensorboard_dir(out, config)
                sinks.append(_TensorBoardSink(tb_dir, resume_step))
            if "wandb" in config.sinks:
                where = "output_dir (its wandb folder)"
                sinks.append(_WandbSink(out, config, run_name, resume_step, hparams))
        except BaseException as e:
            for s in sinks:
                s.close(failed=True)
            if isinstance(e, OSError):
                raise ConfigError(
                    f"config key {where!r}: the metric sinks cannot write there ({type(e).__name__}: {e}); "
                    "name a folder you can write"
                ) from e
            raise
        sinks += [_CallbackSink(obj, spec) for spec, obj in loaded]
        sinks += [_CallbackSink(obj, type(obj).__name__) for obj in callbacks]
        logger.info("run %r: metrics go to %s", run_name, ", ".join(s.name for s in sinks) or "no sink")
        if "wandb" in config.sinks and config.wandb_mode == "offline":
            logger.info("W&B is offline: upload the run later with `wandb sync %s`", out / "wandb")
        return cls(sinks, history)

    def _each(self, call: Callable[[_Sink], None]) -> None:
        if self._closed:
            raise VerlError("the metric sinks are closed; open new ones with MetricSinks.open")
        for s in self._sinks:
            call(s)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of training step ``step`` (1-based).

        One JSON line per call; TensorBoard and W&B get the numeric values; callbacks get
        ``on_step_end`` with all metrics and, when some keys start with ``eval/`` (an evaluation
        ran in this step), ``on_eval`` with those.

        Raises:
            CallbackError: a callback raised (the built-in sinks have written the step already).
        """
        self._each(lambda s: s.log(step, metrics, kind="step"))

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record an evaluation made outside a training step's metrics, e.g. after the last step.

        The JSON line holds ``step`` and these metrics only; callbacks get ``on_eval``. Name the
        keys ``eval/...``. (An evaluation that is part of a step goes through :meth:`log_step`.)

        Raises:
            CallbackError: a callback raised.
        """
        self._each(lambda s: s.log(step, metrics, kind="eval"))

    def checkpoint(self, step: int, path: str | os.PathLike[str]) -> None:
        """Tell the sinks the checkpoint of ``step`` is complete at ``path``: files are flushed and
        callbacks get ``on_checkpoint``.

        Raises:
            CallbackError: a callback raised.
        """
        self._each(lambda s: s.checkpoint(step, Path(path)))

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every sink (a W&B run is finished, marked failed with ``failed``).

        Closing twice does nothing.
        """
        if self._closed:
            return
        self._closed = True
        errors = []
        for s in self._sinks:
            try:
                s.close(failed=failed)
            except Exception as e:  # close the others anyway
                errors.append(f"{s.name}: {type(e).__name__}: {e}")
        if errors:
            raise VerlError(f"closing the metric sinks failed: {'; '.join(errors)}")

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(failed=exc_type is not None)


# ---------------------------------------------------------------------------- progress bar
class ProgressBar:
    """A tqdm bar over the run's steps, showing the live reward, response length and s/step.

    Args:
        total: The run's last step.
        initial: The step the bar starts at (a resumed run's checkpoint step).
        enabled: False draws nothing (config key ``logging.progress``).
        stream: Where the bar goes (default stderr).
    """

    def __init__(
        self, total: int, *, initial: int = 0, enabled: bool = True, stream: IO[str] | None = None
    ) -> None:
        from tqdm import tqdm

        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._step = initial
        self._bar = tqdm(
            total=total, initial=initial, disable=not enabled, file=self._stream, unit="step",
            desc="train", dynamic_ncols=True, leave=True,
        )

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Move the bar to ``metrics["step"]`` and show its reward, length and step time."""
        step = int(metrics["step"])
        parts = []
        if isinstance(metrics.get("reward/mean"), numbers.Real):
            std = metrics.get("reward/std")
            parts.append(f"reward {metrics['reward/mean']:.3f}"
                         + (f" +- {std:.3f}" if isinstance(std, numbers.Real) else ""))
        if isinstance(metrics.get("response/length_mean"), numbers.Real):
            parts.append(f"len {metrics['response/length_mean']:.1f}")
        if isinstance(metrics.get("time/step"), numbers.Real):
            parts.append(f"{metrics['time/step']:.2f}s/step")
        self._bar.set_postfix_str("  ".join(parts), refresh=False)
        self._bar.update(step - self._step)
        self._bar.refresh()
        self._step = step

    def write(self, text: str) -> None:
        """Print a line above the bar (nothing when the bar is disabled)."""
        if self._enabled:
            self._bar.write(text, file=self._stream)

    def close(self) -> None:
        """Leave the bar's last state on screen and end its line."""
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
