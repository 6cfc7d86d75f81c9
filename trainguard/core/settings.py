"""Validated field types and the base model shared by every settings class.

Durations, sizes and limits are parsed once at load time so checks only ever see numbers.

Two modes, chosen once, at this module's import. Everywhere but the agent's own process the settings classes are
pydantic models: the CLI, `trainguard validate`, the tests. The agent (`trainguard run`) validates its config in a
short-lived child process of the first mode (trainguard.agent.plainconfig) and holds the result as plain frozen
classes built from the same class bodies: pydantic, its core library and what they import (libcrypto, email,
importlib.metadata...) are a third of an idle agent's memory, and the agent never validates anything after start.
"""

from __future__ import annotations

import copy
import errno
import inspect
import os
import stat
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from trainguard import PLAIN_SETTINGS_ENV
from trainguard.core.model import Status
from trainguard.core.text import linear
from trainguard.core.units import Limit, parse_count_limit, parse_duration, parse_size, parse_size_limit

PLAIN = os.environ.get(PLAIN_SETTINGS_ENV) == "1"


class Built(NamedTuple):
    """A settings object on its way from the validating child to the agent: the class by import path and the
    validated field values (plain values, Paths, Limits, `Secret`s and further `Built`s)."""

    module: str
    qualname: str
    fields: dict[str, Any]


class Member(NamedTuple):
    """An enum member on its way from the child, by name (the pickle of an enum member is a call of `getattr` on
    some Pythons, which the agent's unpickler does not make)."""

    module: str
    qualname: str
    name: str


class Secret:
    """A validated secret in the agent: never printed, compared by value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"

    def __len__(self) -> int:  # as pydantic's: an empty secret is false (a webhook then signs nothing)
        return len(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Secret, (self._value,))


_MISSING: Any = object()


class _PlainField(NamedTuple):
    default: Any
    default_factory: Callable[[], Any] | None


def _plain_field(default: Any = _MISSING, *_args: Any, default_factory: Callable[[], Any] | None = None,
                 **_info: Any) -> Any:
    """`Field` in the agent: only the default matters, the values come validated."""
    return _PlainField(default, default_factory)


def _plain_validator(*_args: Any, **_kwargs: Any) -> Callable[[Any], Any]:
    """`field_validator`/`model_validator` in the agent: the child validated; the method stays, unused."""
    return lambda method: method


class PlainSettings:
    """A settings class in the agent: the fields its class bodies annotate, frozen, compared by value. Built from
    the child's validated values; a class made in code (a check's fixed settings) takes its keyword arguments as
    they are, with the class's defaults for the rest."""

    _fields: ClassVar[dict[str, _PlainField]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields: dict[str, _PlainField] = {}
        for klass in reversed(cls.__mro__):
            for name, annotation in inspect.get_annotations(klass).items():  # the class's own, as written
                if name.startswith("_") or name == "model_config" or "ClassVar" in str(annotation):
                    continue
                value = vars(klass).get(name, _MISSING)
                fields[name] = value if isinstance(value, _PlainField) else _PlainField(value, None)
        cls._fields = fields

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(self._fields))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown field(s) {', '.join(unknown)}")
        for name, spec in self._fields.items():
            if name in values:
                value = values[name]
            elif spec.default_factory is not None:
                value = spec.default_factory()
            elif spec.default is _MISSING:
                raise TypeError(f"{type(self).__name__}: {name} is required")
            else:
                value = copy.deepcopy(spec.default)
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), *vars(self).values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _check_regex(value: str) -> str:
    """Config patterns match text jobs control (command lines, log lines): RE2 syntax, linear time."""
    linear(value)  # ValueError naming the pattern and RE2's reason
    return value


def _parse_status(value: object) -> Status:
    if isinstance(value, Status):
        return value
    if isinstance(value, str):
        return Status.parse(value)
    raise ValueError(f"invalid status {value!r}: expected one of ok, unknown, warning, critical")


def read_small_file(path: Path, limit: int = 1 << 20) -> bytes:
    """A regular file of at most `limit` bytes: a FIFO or a device named by mistake never blocks the agent."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes")
    return data


def is_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return SecretStr in typing.get_args(annotation)
    return False


if PLAIN:
    Field = _plain_field
    field_validator = model_validator = _plain_validator
    SecretStr = Secret
    NonNegativeInt = PositiveInt = int
    PositiveFloat = float
    Duration = float
    Size = int
    SizeLimit = CountLimit = Limit
    Regex = str
    StatusName = Status

    class SettingsModel(PlainSettings):  # type: ignore[no-redef]
        """The agent's settings: validated in the child, held here as plain frozen classes."""

else:
    from typing import Annotated

    from pydantic import (
        AfterValidator,
        BaseModel,
        BeforeValidator,
        ConfigDict,
        Field,
        NonNegativeInt,
        PlainSerializer,
        PlainValidator,
        PositiveFloat,
        PositiveInt,
        SecretStr,
        field_validator,
        model_validator,
    )

    Duration = Annotated[float, BeforeValidator(parse_duration), PlainSerializer(lambda s: f"{s:g}s", return_type=str)]
    Size = Annotated[int, BeforeValidator(parse_size)]
    SizeLimit = Annotated[Limit, PlainValidator(parse_size_limit), PlainSerializer(Limit.size_text, return_type=str)]
    CountLimit = Annotated[Limit, PlainValidator(parse_count_limit), PlainSerializer(str, return_type=str)]
    Regex = Annotated[str, AfterValidator(_check_regex)]
    StatusName = Annotated[Status, PlainValidator(_parse_status), PlainSerializer(lambda s: s.label, return_type=str)]

    class SettingsModel(BaseModel):
        """Frozen, strict settings: an unknown key is an error, never silently ignored.

        Every `SecretStr` field `x` may instead be given as `x_file` (path to a file holding it) or `x_env`
        (name of an environment variable), so secrets need not sit in a world-readable config file.
        """

        model_config = ConfigDict(extra="forbid", frozen=True)

        @model_validator(mode="before")
        @classmethod
        def _resolve_secret_indirection(cls, data: Any) -> Any:
            if not isinstance(data, dict):
                return data
            data = dict(data)
            for name, info in cls.model_fields.items():
                if not is_secret(info.annotation):
                    continue
                sources = [k for k in (name, f"{name}_file", f"{name}_env") if k in data]
                if len(sources) > 1:
                    raise ValueError(f"{name}: give only one of {', '.join(sources)}")
                if f"{name}_file" in data:
                    path = Path(str(data.pop(f"{name}_file")))
                    try:
                        data[name] = read_small_file(path).decode("utf-8").strip()
                    except (OSError, UnicodeDecodeError) as exc:
                        raise ValueError(f"{name}_file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
                elif f"{name}_env" in data:
                    var = str(data.pop(f"{name}_env"))
                    if var not in os.environ:
                        raise ValueError(f"{name}_env: environment variable {var} is not set")
                    data[name] = os.environ[var]
            return data


# What the settings modules take from here, in either mode.
__all__ = ["PLAIN", "Built", "CountLimit", "Duration", "Field", "Member", "NonNegativeInt", "PlainSettings",
           "PositiveFloat", "PositiveInt", "Regex", "Secret", "SecretStr", "SettingsModel", "Size", "SizeLimit", "StatusName",
           "field_validator", "is_secret", "model_validator", "read_small_file"]
