"""What travels between sandbox clients, the gateway and the sandbox servers: one definition each.

The client builds an exec from `ExecRequest`, the gateway reads the same model to cap a
proxied exec's timeout, the server validates it; results come back as `ExecResult`,
`ReadResult`, `WriteResult`, and errors as `ApiError` (status, machine-readable `error`,
human `detail`). Results index like the dicts they used to be (`r["exit_code"]`), so
code written against the old dict answers keeps working.

The streamed exec (`/v1/exec/stream`, large stdin) sends one line of `ExecRequest` JSON,
a newline, then stdin as raw bytes to the end of the body: `stream_head` builds that line.

Standard library only (no pydantic): the sandbox server runs from this module in task
images that have nothing but a `python3` (docs/sandboxes.md, "The server in a task's own
image"), and pydantic's core is a compiled extension that cannot be copied into them. The
models are plain classes whose annotations `_Model` reads: `Model.validate(dict)` checks a
parsed JSON document and raises `Invalid` (a ValueError) with pydantic-style errors
(`{"loc": (...), "msg": ...}`); constructing with keyword arguments checks the same way;
`Model.unchecked(**values)` builds one without checks (the client: the server's 422 stays
the one answer to a malformed call); `dump()` gives the dict, `fields_set` what was given.
The rules: every field's type is checked (a str is no number, a bool is no int, an int is
accepted for a float and becomes one), `Field` bounds (gt, ge, le, min_length,
max_length), `Literal` choices, field checks (`check=`); requests refuse unknown fields,
results keep them.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Literal

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: content type of a streamed exec's body: a JSON line, then raw stdin
EXEC_STREAM_TYPE = "application/x-asyncgrpo-exec-stream"
Encoding = Literal["utf-8", "base64"]


class Invalid(ValueError):
    """A document that does not fit its model: `errors` lists each problem, in field order."""

    def __init__(self, model: str, errors: list[dict]):
        super().__init__(f"{len(errors)} validation error(s) for {model}: "
                         + "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in errors))
        self.errors = errors


# fields -------------------------------------------------------------------------------
_MISSING: Any = object()


class _FieldInfo:
    __slots__ = (
        "check",
        "default",
        "default_factory",
        "description",
        "ge",
        "gt",
        "le",
        "max_length",
        "min_length",
    )

    def __init__(self, default=_MISSING, *, default_factory: Callable[[], Any] | None = None,
                 gt: float | None = None, ge: float | None = None, le: float | None = None,
                 min_length: int | None = None, max_length: int | None = None,
                 check: Callable[[Any], None] | None = None, description: str = ""):
        self.default, self.default_factory = default, default_factory
        self.gt, self.ge, self.le = gt, ge, le
        self.min_length, self.max_length = min_length, max_length
        self.check, self.description = check, description

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is None

    def make_default(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default


def Field(default=_MISSING, **kwargs) -> Any:
    """A field's default and rules: `gt`/`ge`/`le` (numbers), `min_length`/`max_length`
    (strings and lists), `check(value)` raising ValueError, `default_factory`, `description`."""
    return _FieldInfo(default, **kwargs)


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is str:
        return "a valid string"
    if tp is bool:
        return "a valid boolean"
    if tp is int:
        return "a valid integer"
    if tp is float:
        return "a valid number"
    if tp is type(None):
        return "None"
    if origin is list:
        return "a valid list"
    if origin is dict:
        return "a valid dictionary"
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(m) for m in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, _Model):
        return f"a valid dictionary or instance of {tp.__name__}"
    return str(tp)


Checker = Callable[[Any, tuple, list], Any]


def _wrong(tp) -> Checker:
    msg = f"Input should be {_describe(tp)}"

    def wrong(value, loc, errors):
        errors.append({"loc": loc, "msg": msg})
        return value

    return wrong


def _compile(tp) -> Checker:
    """`check(value, loc, errors)`: `value` as type `tp` (an int becomes a float where a float
    is expected), or the value unchanged and an error appended. Built once per field."""
    origin = typing.get_origin(tp)
    wrong = _wrong(tp)
    if tp is Any:
        return lambda value, loc, errors: value
    if origin is typing.Union or origin is types.UnionType:
        members = typing.get_args(tp)
        optional = type(None) in members
        rest = [m for m in members if m is not type(None)]
        if len(rest) == 1:
            inner = _compile(rest[0])

            def one(value, loc, errors):
                return None if value is None and optional else inner(value, loc, errors)

            return one
        kinds = [(typing.get_origin(m) or m, _compile(m)) for m in rest]
        wrong = _wrong(typing.Union[tuple(rest)])  # noqa: UP007 - a Union made at run time; no None

        def union(value, loc, errors):
            if value is None and optional:
                return None
            closest = None
            for kind, check in kinds:
                found: list[dict] = []
                out = check(value, loc, found)
                if not found:
                    return out
                if isinstance(kind, type) and isinstance(value, kind):
                    closest = found  # the member of the value's own kind says what is wrong in it
            if closest is None:
                return wrong(value, loc, errors)
            errors.extend(closest)
            return value

        return union
    if tp is float:
        def number(value, loc, errors):
            if isinstance(value, float):
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            return wrong(value, loc, errors)

        return number
    if tp is int:
        return lambda value, loc, errors: (value if isinstance(value, int) and not isinstance(value, bool)
                                           else wrong(value, loc, errors))
    if tp in (str, bool, type(None)):
        return lambda value, loc, errors: value if isinstance(value, tp) else wrong(value, loc, errors)
    if origin is Literal:
        choices = {(type(a), a) for a in typing.get_args(tp)}
        return lambda value, loc, errors: (value if (type(value), value) in choices
                                           else wrong(value, loc, errors))
    if origin is list:
        (item,) = [_compile(a) for a in typing.get_args(tp)]

        def items(value, loc, errors):
            if type(value) is not list:
                return wrong(value, loc, errors)
            return [item(v, (*loc, i), errors) for i, v in enumerate(value)]

        return items
    if origin is dict:
        key, val = [_compile(a) for a in typing.get_args(tp)]

        def mapping(value, loc, errors):
            if type(value) is not dict:
                return wrong(value, loc, errors)
            return {key(k, (*loc, k), errors): val(v, (*loc, k), errors) for k, v in value.items()}

        return mapping
    if isinstance(tp, type) and issubclass(tp, _Model):
        def model(value, loc, errors):
            if isinstance(value, tp):
                return value
            if type(value) is dict:
                return tp._from(value, loc, errors)
            return wrong(value, loc, errors)

        return model
    raise TypeError(f"unsupported field type {tp!r}")  # pragma: no cover - a model's own mistake


def _rules(info: _FieldInfo) -> Callable[[Any], str | None] | None:
    """The field's own rules as one function: what is wrong with a value of the right type, or
    None (None itself passes: it is "not given"); no function where the field has no rules."""
    checks: list[Callable[[Any], str | None]] = []
    number = (int, float)
    if info.gt is not None:
        gt = info.gt
        checks.append(lambda v: None if not isinstance(v, number) or v > gt else f"Input should be greater than {gt}")
    if info.ge is not None:
        ge = info.ge
        checks.append(lambda v: None if not isinstance(v, number) or v >= ge
                      else f"Input should be greater than or equal to {ge}")
    if info.le is not None:
        le = info.le
        checks.append(lambda v: None if not isinstance(v, number) or v <= le
                      else f"Input should be less than or equal to {le}")

    def _unit(v, n: int) -> str:
        what, unit = ("String", "character") if isinstance(v, str) else ("List", "item")
        return f"{what} should have {{}} {n} {unit}{'s' * (n != 1)}"

    if info.min_length is not None:
        lo = info.min_length
        checks.append(lambda v: None if not isinstance(v, (str, list)) or len(v) >= lo
                      else _unit(v, lo).format("at least"))
    if info.max_length is not None:
        hi = info.max_length
        checks.append(lambda v: None if not isinstance(v, (str, list)) or len(v) <= hi
                      else _unit(v, hi).format("at most") + (f", not {len(v)}" if isinstance(v, list) else ""))
    if info.check is not None:
        own = info.check

        def checked(v) -> str | None:
            try:
                own(v)
            except ValueError as err:
                return f"Value error, {err}"
            return None

        checks.append(checked)
    if not checks:
        return None

    def rules(value) -> str | None:
        if value is None:
            return None
        for check in checks:  # the first broken rule only, as pydantic reported it
            problem = check(value)
            if problem is not None:
                return problem
        return None

    return rules


# models -------------------------------------------------------------------------------
class _Model:
    """Fields from the class's annotations (a `Field(...)` or a plain default as the value).

    `extra` says what unknown keys do: "forbid" (requests: an error) or "allow" (results:
    kept as attributes, so a newer server's extra keys reach the caller; one named like a
    method of the class is dropped).
    """

    __slots__ = ("__dict__", "_fields_set")
    extra: ClassVar[str] = "forbid"
    _fields: ClassVar[dict[str, tuple[Checker, _FieldInfo, Callable | None]] | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fields = None  # resolved on first use: a model may name one defined after it

    @classmethod
    def _spec(cls) -> dict[str, tuple[Checker, _FieldInfo, Callable | None]]:
        """name -> (its type's checker, its Field, its own rules: `_rules`)."""
        spec = cls.__dict__.get("_fields")
        if spec is None:
            hints = typing.get_type_hints(cls)
            spec = {}
            for klass in reversed(cls.__mro__):
                for name in inspect.get_annotations(klass):
                    if name.startswith("_") or typing.get_origin(hints[name]) is ClassVar or name == "extra":
                        continue
                    declared = klass.__dict__.get(name, _MISSING)
                    info = declared if isinstance(declared, _FieldInfo) else _FieldInfo(declared)
                    spec[name] = (_compile(hints[name]), info, _rules(info))
            cls._fields = spec
        return spec

    @classmethod
    def _from(cls, data: dict, loc: tuple, errors: list[dict]) -> _Model:
        self = cls.__new__(cls)
        values = self.__dict__
        spec = cls._fields if cls._fields is not None else cls._spec()
        given = 0
        for name, (check, info, rules) in spec.items():
            if name in data:
                given += 1
                before = len(errors)
                value = values[name] = check(data[name], (*loc, name), errors)
                if rules is not None and len(errors) == before:
                    problem = rules(value)
                    if problem is not None:
                        errors.append({"loc": (*loc, name), "msg": problem})
            elif info.required:
                errors.append({"loc": (*loc, name), "msg": "Field required"})
            else:
                values[name] = info.make_default()
        if given < len(data):  # keys that are no field
            for name, value in data.items():
                if name not in spec:
                    if cls.extra == "forbid" or not isinstance(name, str):
                        errors.append({"loc": (*loc, name), "msg": "Extra inputs are not permitted"})
                    elif not hasattr(cls, name):  # never over a method (`get`) or the slot
                        values[name] = value
        object.__setattr__(self, "_fields_set", frozenset(data))
        return self

    @classmethod
    def validate(cls, data: Any):
        """A parsed JSON document as this model, or `Invalid` with every problem."""
        errors: list[dict] = []
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise Invalid(cls.__name__, [{"loc": (), "msg": f"Input should be {_describe(cls)}"}])
        out = cls._from(data, (), errors)
        if errors:
            raise Invalid(cls.__name__, errors)
        return out

    @classmethod
    def unchecked(cls, **values):
        """The model with `values` as they are (no checks; unset fields take their defaults)."""
        self = cls.__new__(cls)
        for name, (_check, info, _rules) in cls._spec().items():
            self.__dict__[name] = values[name] if name in values else info.make_default()
        self.__dict__.update((k, v) for k, v in values.items() if k not in self.__dict__)
        object.__setattr__(self, "_fields_set", frozenset(values))
        return self

    def __init__(self, **values):
        errors: list[dict] = []
        done = type(self)._from(values, (), errors)
        if errors:
            raise Invalid(type(self).__name__, errors)
        self.__dict__.update(done.__dict__)
        object.__setattr__(self, "_fields_set", done._fields_set)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assignment is unchecked (as pydantic's default) and marks the field as set."""
        self.__dict__[name] = value
        object.__setattr__(self, "_fields_set", self._fields_set | {name})

    def __getstate__(self) -> tuple[dict, frozenset[str]]:
        return dict(self.__dict__), self._fields_set

    def __setstate__(self, state: tuple[dict, frozenset[str]]) -> None:
        """For pickle and copy (which would set the slot through `__setattr__`)."""
        self.__dict__.update(state[0])
        object.__setattr__(self, "_fields_set", state[1])

    @property
    def fields_set(self) -> frozenset[str]:
        return self._fields_set

    def dump(self, *, exclude_unset: bool = False, exclude: frozenset[str] | set[str] = frozenset()) -> dict:
        """The model as plain JSON-ready values (nested models as dicts, extra keys kept)."""
        return {k: _plain(v) for k, v in self.__dict__.items()
                if k not in exclude and (not exclude_unset or k in self._fields_set)}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _plain(value: Any) -> Any:
    if isinstance(value, _Model):
        return value.dump()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Strict(_Model):
    extra = "forbid"


class _Answer(_Model):
    """A result: attributes, and `r["key"]`/`r.get` for callers written against dicts."""

    extra = "allow"

    def __getitem__(self, key: str) -> Any:
        return self.__dict__[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)


def _command(v) -> None:
    if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
        raise ValueError("command is empty")
    if isinstance(v, list) and any("\x00" in a for a in v) or isinstance(v, str) and "\x00" in v:
        raise ValueError("command contains NUL")


def _env_names(v: dict[str, str]) -> None:
    for k, val in v.items():
        if not _ENV_NAME.match(k) or "\x00" in val:
            raise ValueError(f"invalid environment variable {k!r}")


# requests -----------------------------------------------------------------------------
class ExecRequest(_Strict):
    command: str | list[str] = Field(check=_command, description="shell string (run by the server's shell) or argv")
    timeout_seconds: float | None = Field(None, gt=0)
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict, check=_env_names)
    cwd: str | None = Field(None, description="directory relative to the session directory")
    session: str | None = None
    max_output_bytes: int | None = Field(None, ge=0)
    output_encoding: Encoding = Field(
        "utf-8", description="base64: stdout/stderr exactly as written (binary-safe); utf-8: decoded, "
        "invalid bytes replaced")

    def body(self) -> dict:
        """The JSON body: only what was set, so the server's defaults apply to the rest."""
        return self.dump(exclude_unset=True)

    def stream_head(self) -> bytes:
        """The first line of a streamed exec's body (stdin follows it raw)."""
        import json

        head = self.dump(exclude_unset=True, exclude={"stdin"})
        return json.dumps(head, separators=(",", ":")).encode() + b"\n"


class ReadRequest(_Strict):
    path: str
    session: str | None = None
    max_bytes: int | None = Field(None, ge=0)
    encoding: Encoding = "utf-8"


class WriteRequest(_Strict):
    path: str
    content: str
    session: str | None = None
    encoding: Encoding = "utf-8"
    mode: int = Field(0o644, ge=0, le=0o777)


class ResetRequest(_Strict):
    lease_secret: str | None = Field(None, min_length=16, max_length=256,
                                     description="secret of the next lease, accepted once the reset is done")


class ScoreRequest(_Strict):
    """Score a rollout where it never ran (`POST /v1/score`, lease secret).

    The server kills every process of the sandbox, keeps only the `editable` paths of
    `session` (regular files, no symlinks), wipes the workspace, builds a fresh scoring
    session from the template, `files` (the row's files: its tests restored) and the kept
    editable files, and runs `command` there in a clean, isolated environment.
    """

    session: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="the row's files, written first (tests restored)")
    editable: list[str] = Field(default_factory=list, max_length=1024,
                                description="paths the rollout may change: only these are carried over")
    command: str | list[str] = Field(description="the row's test command")
    timeout_seconds: float | None = Field(None, gt=0)
    max_output_bytes: int | None = Field(None, ge=0)


class LeaseRequest(_Strict):
    group_id: str = Field(min_length=1, max_length=256)
    wait_seconds: float | None = Field(None, ge=0)
    group_key: str | None = Field(
        None, min_length=16, max_length=256,
        description="the credential of the group: requests naming the same group_id join one "
        "lease only if they carry the same key (the gateway files the group under its digest); "
        "without it the lease can be joined by nobody. A group id alone is no credential.")
    image: str | None = Field(
        None, min_length=1, max_length=512,
        description="the container image the group's sandbox runs (a task's own image); None for the "
        "run's default image")


class HeldLease(_Strict):
    lease_id: str = Field(min_length=1, max_length=256)
    secret: str = Field(min_length=1, max_length=256)


class HeartbeatsRequest(_Strict):
    """Many leases' heartbeats in one call (`POST /v1/heartbeats`): a process beats every
    lease it holds at once, so the gateway's cost per lease is a dict lookup, not a request."""

    leases: list[HeldLease] = Field(max_length=4096)


# results ------------------------------------------------------------------------------
class ExecResult(_Answer):
    exit_code: int | None
    stdout: str
    stderr: str
    output_encoding: Encoding = "utf-8"
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool
    duration_seconds: float


class ScoreResult(ExecResult):
    editable_found: list[str] = Field(default_factory=list, description="editable paths carried over")


class ReadResult(_Answer):
    path: str
    content: str
    size: int
    truncated: bool
    encoding: Encoding = "utf-8"


class WriteResult(_Answer):
    path: str
    bytes: int


# errors -------------------------------------------------------------------------------
class ApiError(Exception):
    """A refusal with a reason, raised by the servers' handlers.

    On the wire `{"detail": {"error": ..., "detail": ...}}` (the envelope FastAPI gave handler
    errors, kept: the clients unwrap it into `SandboxError` and its kinds); the servers turn
    it into that response (`api_error_response`). Plain Exception, not Starlette's
    HTTPException: the clients import this module, and the trainer image has no Starlette.
    """

    def __init__(self, status: int, error: str, detail: Any = "", headers: dict[str, str] | None = None):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail, self.headers = status, error, detail, headers

    def body(self) -> dict:
        return {"detail": {"error": self.error, "detail": self.detail}}


async def api_error_response(_request, exc: ApiError):
    """The exception handler both servers register for `ApiError`."""
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def read_stream_head(chunks: AsyncIterator[bytes], cap: int) -> tuple[bytes, bytes]:
    """(the first line of a streamed body, the bytes after it); 413 past `cap` without one."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        line_end = buf.find(b"\n")
        if line_end >= 0:
            return bytes(buf[:line_end]), bytes(buf[line_end + 1 :])
        if len(buf) > cap:
            break
    if len(buf) > cap:
        raise ApiError(413, "too_large", f"the request line of a streamed exec is over {cap} bytes")
    raise ApiError(400, "bad_request", "a streamed exec's body starts with one line of JSON and a newline")
