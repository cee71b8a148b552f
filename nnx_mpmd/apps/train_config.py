"""``nnx-mpmd train --config FILE.toml``: the options of a run as a flat TOML file.

Every option of ``nnx-mpmd train`` has a key: its long name without the
dashes, ``-`` written ``_`` (``--batch-size 8`` is ``batch_size = 8``, a switch
such as ``--scan-layers`` is ``scan_layers = true``). The keys come from the
argument parser (`config_keys`), so an option added to it has its key at once.
The layers, lowest first:

1. the parser's defaults;
2. with ``--resume``, the run's saved ``RUN/config.toml``;
3. the ``--config`` file;
4. the command line.

A run prints its resolved configuration at the start and process 0 writes it
to ``RUN/config.toml`` (`write_run_config`), without the keys that concern one
invocation only (`PER_INVOCATION_KEYS`): ``--resume`` with no other option
continues with the saved configuration.

An unknown key, a value of the wrong type, an unreadable file or a table
(the file is flat) is refused with one `nnx_mpmd.errors.MpmdError` line
before anything is written. This module imports no JAX.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--batch-size", type=int, default=32)
    >>> _ = p.add_argument("--scan-layers", action="store_true")
    >>> sorted(config_keys(p))
    ['batch_size', 'scan_layers']
    >>> print(toml_text({"batch_size": 8, "scan_layers": True, "plan": None}), end="")
    batch_size = 8
    scan_layers = true
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from nnx_mpmd.errors import MpmdError

__all__ = [
    "CONFIG_FILE",
    "PER_INVOCATION_KEYS",
    "ConfigKey",
    "config_keys",
    "config_summary",
    "parse_layered",
    "read_config_file",
    "resolved_config",
    "toml_text",
    "write_run_config",
]

#: The resolved configuration of a run, in its run directory.
CONFIG_FILE = "config.toml"
#: Keys that describe one invocation, not the run: not saved in ``RUN/config.toml``
#: (a resumed run would otherwise stop at the old ``--stop-at`` at once, say).
PER_INVOCATION_KEYS = (
    "config",
    "run_dir",
    "resume",
    "resume_step",
    "allow_changed_settings",
    "stop_at",
)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of the configuration file: the option it stands for and its value's type.

    Attributes:
      name: the key (the option's ``dest``, e.g. ``batch_size``).
      option: the option, e.g. ``--batch-size``.
      kind: ``bool``, ``int``, ``float`` or ``str``.
      choices: the values allowed, or None.
    """

    name: str
    option: str
    kind: type
    choices: tuple[Any, ...] | None = None

    def check(self, value: Any, where: str) -> Any:
        """``value`` if it has this key's type (an int is a float too); else an error.

        Raises:
          MpmdError: the value's type or choice is wrong, naming the key and ``where``.
        """
        ok = {
            bool: lambda v: isinstance(v, bool),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        }.get(self.kind, lambda v: isinstance(v, str))
        if not ok(value):
            raise MpmdError(
                f"{where}: key {self.name!r} ({self.option}) must be a TOML "
                f"{_TOML_TYPE[self.kind]}, not {type(value).__name__} {value!r}; e.g. "
                f"{self.name} = {_EXAMPLE[self.kind]}."
            )
        if self.choices is not None and value not in self.choices:
            raise MpmdError(
                f"{where}: key {self.name!r} is {value!r}; choose one of {list(self.choices)}."
            )
        return float(value) if self.kind is float else value


_TOML_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string"}
_EXAMPLE = {bool: "true", int: "8", float: "3e-3", str: '"text"'}


def _kind(action: argparse.Action) -> type:
    """The Python type an option's value has in the file."""
    if action.nargs == 0:  # store_true / store_false / store_const
        return bool
    if action.type in (int, float):
        return action.type
    return str  # also options with a converter of strings: argparse applies it


def config_keys(parser: argparse.ArgumentParser) -> dict[str, ConfigKey]:
    """``{key: ConfigKey}`` of the config file: one per long option of ``parser`` but ``--help``.

    Example:
      >>> from nnx_mpmd.apps.train_args import build_parser
      >>> keys = config_keys(build_parser())
      >>> keys["batch_size"].option, keys["scan_layers"].kind
      ('--batch-size', <class 'bool'>)
    """
    keys: dict[str, ConfigKey] = {}
    for action in parser._actions:  # the documented attribute argparse keeps them in
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.default == argparse.SUPPRESS:  # --help
            continue
        choices = tuple(action.choices) if action.choices is not None else None
        keys[action.dest] = ConfigKey(action.dest, longs[0], _kind(action), choices)
    return keys


def read_config_file(path: str | pathlib.Path, keys: Mapping[str, ConfigKey]) -> dict[str, Any]:
    """``{key: value}`` of a flat TOML options file, every key and value checked against ``keys``.

    Raises:
      MpmdError: the file is missing or not TOML, holds a table, an unknown key
        (the message lists the valid ones) or a value of the wrong type.

    Example:
      >>> import tempfile
      >>> from nnx_mpmd.apps.train_args import build_parser
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
      >>> _ = f.write_text("batch_size = 8\\nlr = 1\\n")
      >>> read_config_file(f, config_keys(build_parser()))
      {'batch_size': 8, 'lr': 1.0}
    """
    import tomllib

    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MpmdError(f"--config {path}: no such file; check the path.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MpmdError(f"--config {path} cannot be read ({e}); check the file.") from None
    except tomllib.TOMLDecodeError as e:
        raise MpmdError(
            f"--config {path} is not valid TOML ({e}); write one key = value per line, "
            "e.g. batch_size = 8."
        ) from None
    values: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict):
            raise MpmdError(
                f"--config {path}: [{name}] is a table, but the file is flat; write its keys "
                "at the top, one option per line (e.g. batch_size = 8)."
            )
        if name not in keys or name == "config":
            valid = ", ".join(k for k in keys if k != "config")
            raise MpmdError(f"--config {path}: unknown key {name!r}; the valid keys are: {valid}.")
        values[name] = keys[name].check(value, f"--config {path}")
    return values


_Options = TypeVar("_Options", bound=argparse.Namespace)


def parse_layered(
    parser: argparse.ArgumentParser,
    argv: list[str],
    namespace: _Options,
    saved_config: Callable[[argparse.Namespace], pathlib.Path | None],
) -> _Options:
    """Parses ``argv`` over the ``--config`` file over a resumed run's saved configuration.

    ``saved_config(options so far)`` gives the run's saved ``config.toml``, or None.

    Raises:
      MpmdError: a bad ``--config`` file or saved configuration (`read_config_file`).

    Example:
      >>> import argparse
      >>> p = argparse.ArgumentParser()
      >>> _ = p.add_argument("--steps", type=int, default=300)
      >>> _ = p.add_argument("--config", default=None)
      >>> _ = p.add_argument("--resume", action="store_true")
      >>> parse_layered(p, ["--steps", "5"], argparse.Namespace(), lambda ns: None).steps
      5
    """
    keys = config_keys(parser)
    given = parser.parse_args(argv)
    from_file = read_config_file(given.config, keys) if given.config else {}
    parser.set_defaults(**from_file)
    options = parser.parse_args(argv)
    saved_path = saved_config(options) if options.resume else None
    if saved_path is not None and saved_path.is_file():
        saved = read_config_file(saved_path, keys)
        for name in PER_INVOCATION_KEYS:
            saved.pop(name, None)
        parser.set_defaults(**{**saved, **from_file})
    return parser.parse_args(argv, namespace=namespace)


def resolved_config(cfg: argparse.Namespace, keys: Mapping[str, ConfigKey]) -> dict[str, Any]:
    """The value of every key in ``cfg`` (None for those it lacks or leaves unset).

    Example:
      >>> from nnx_mpmd.apps.train_args import build_parser, config_from_args
      >>> keys = config_keys(build_parser())
      >>> resolved_config(config_from_args(["--steps", "7"]), keys)["steps"]
      7
    """
    return {name: getattr(cfg, name, None) for name in keys}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    # JSON's escapes (\\ \" \n \t and \u with four hex digits) are TOML's basic-string escapes too.
    return json.dumps(str(value))


def toml_text(values: Mapping[str, Any]) -> str:
    """A flat TOML document of ``values`` (str, int, float, bool); None values are left out.

    Example:
      >>> print(toml_text({"lr": 0.003, "run_dir": 'a "b"', "stages": None}), end="")
      lr = 0.003
      run_dir = "a \\"b\\""
    """
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def config_summary(values: Mapping[str, Any]) -> str:
    """The one-line form of a resolved configuration that a run prints at its start.

    Example:
      >>> config_summary({"steps": 3, "plan": None, "lr": 0.003})
      'configuration: steps=3 lr=0.003'
    """
    shown = " ".join(f"{k}={v}" for k, v in values.items() if v is not None)
    return f"configuration: {shown}"


def write_run_config(run_dir: pathlib.Path, values: Mapping[str, Any]) -> pathlib.Path:
    """Writes ``RUN/config.toml``: ``values`` without the `PER_INVOCATION_KEYS`; returns its path.

    Example:
      >>> import tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> write_run_config(d, {"steps": 3, "resume": True}).read_text()
      '# nnx-mpmd train: the resolved configuration of this run\\nsteps = 3\\n'
    """
    kept = {k: v for k, v in values.items() if k not in PER_INVOCATION_KEYS}
    path = pathlib.Path(run_dir) / CONFIG_FILE
    header = "# nnx-mpmd train: the resolved configuration of this run\n"
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(header + toml_text(kept), encoding="utf-8")
    tmp.replace(path)
    return path
