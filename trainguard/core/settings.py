"""Validated field types and the base model shared by every settings class.

Durations, sizes and limits are parsed once at load time so checks only ever see numbers.
"""

from __future__ import annotations

import errno
import os
import stat
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    SecretStr,
    model_validator,
)

from trainguard.core.model import Status
from trainguard.core.text import linear
from trainguard.core.units import Limit, parse_count_limit, parse_duration, parse_size, parse_size_limit

Duration = Annotated[float, BeforeValidator(parse_duration), PlainSerializer(lambda s: f"{s:g}s", return_type=str)]
Size = Annotated[int, BeforeValidator(parse_size)]
SizeLimit = Annotated[Limit, PlainValidator(parse_size_limit), PlainSerializer(Limit.size_text, return_type=str)]
CountLimit = Annotated[Limit, PlainValidator(parse_count_limit), PlainSerializer(str, return_type=str)]


def _check_regex(value: str) -> str:
    """Config patterns match text jobs control (command lines, log lines): RE2 syntax, linear time."""
    linear(value)  # ValueError naming the pattern and RE2's reason
    return value


Regex = Annotated[str, AfterValidator(_check_regex)]


def _parse_status(value: object) -> Status:
    if isinstance(value, Status):
        return value
    if isinstance(value, str):
        return Status.parse(value)
    raise ValueError(f"invalid status {value!r}: expected one of ok, unknown, warning, critical")


StatusName = Annotated[Status, PlainValidator(_parse_status), PlainSerializer(lambda s: s.label, return_type=str)]


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
