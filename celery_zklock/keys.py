"""Task arguments -> lock keys: templates, callables, and a typed default key.

Keys become znode names in :mod:`celery_zklock.layout`.

Example::

    >>> default_key("billing.charge", {"invoice_id": 42})
    'billing.charge:{"invoice_id":42}'
"""

from __future__ import annotations

import datetime
import decimal
import functools
import inspect
import json
import re
import string
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .exceptions import ConfigurationError, KeyBuildError
from .layout import MAX_NAME, check_key, encode_key

__all__ = ["MAX_NAME", "KeyBuildError", "KeyPart", "bind_arguments", "build_keys", "build_path", "check_key",
           "check_key_parts", "check_path_template", "check_znode_path", "default_key", "encode_key"]

#: One part of a task's lock key: a ``str.format`` template over the task's
#: arguments, or a callable taking the task's arguments and returning a str.
KeyPart = Union[str, Callable[..., str]]


def _template_roots(template: str) -> List[str]:
    """The argument names a template refers to: ``"{order.id}-{items[0]}"`` -> ["order", "items"]."""
    roots = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        roots.append(root)
    return roots


def check_key_parts(key: Any, fn: Callable[..., Any], where: str) -> Tuple[KeyPart, ...]:
    """Validate a ``key`` option against ``fn``'s signature when the task is defined.

    Returns the parts (empty for "no key": the default key is used). ``where``
    names the task and option in error messages.
    """
    if key is None:
        return ()
    parts = list(key) if isinstance(key, (list, tuple)) else [key]
    if not parts:
        raise ConfigurationError(f"{where}: key must not be an empty list")
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for part in parts:
        if callable(part):
            continue
        if not isinstance(part, str):
            raise ConfigurationError(
                f"{where}: key must be a str template, a callable or a list of these, not {type(part).__name__}")
        try:
            roots = _template_roots(part)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: key template {part!r} is malformed: {exc}") from None
        for root in roots:
            if root == "" or root.isdigit():
                raise ConfigurationError(f"{where}: key template {part!r} must name arguments, like {{invoice_id}}")
            if root not in params and not takes_any:
                raise ConfigurationError(
                    f"{where}: key template {part!r} names {root!r}, which is not an argument of "
                    f"{fn.__name__}{inspect.signature(fn)}")
    return tuple(parts)


def bind_arguments(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                   skip_first: bool = False) -> Dict[str, Any]:
    """The task's arguments by name, defaults applied (``**kwargs`` contents merged in)."""
    sig = _signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    names = list(sig.parameters)
    values: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if skip_first and name == names[0]:
            continue  # the task itself, for bind=True
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        else:
            values[name] = value
    return values


@functools.lru_cache(maxsize=1024)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)  # slow enough to matter on every task call


def default_key(task_name: str, arguments: Mapping[str, Any]) -> str:
    """The task's name plus a canonical rendering of its arguments (independent of their order).

    Strings are JSON strings and every other type has its own unquoted form, so
    arguments that differ (``1``, ``"1"``, ``1.0``, ``True``, ``b"1"``) give
    different keys. Tuples render as lists: Celery's JSON serializer delivers
    them as lists, and a task must lock the same key when it is retried.
    Types with no stable rendering raise :class:`KeyBuildError`.

        >>> default_key("billing.charge", {"invoice_id": 42, "note": None})
        'billing.charge:{"invoice_id":42,"note":null}'
    """
    try:
        return f"{task_name}:" + _render(dict(arguments))
    except RecursionError:
        raise KeyBuildError(f"task {task_name}: its arguments nest too deeply (or contain themselves) "
                            "to build a default lock key; give key=...") from None
    except _Unrenderable as exc:
        raise KeyBuildError(f"task {task_name}: argument value of type {exc} has no stable rendering for a "
                            "lock key; give key=... naming what identifies the work") from None


class _Unrenderable(Exception):
    pass


def _render(value: Any) -> str:
    # One unambiguous grammar: strings are JSON-quoted and every other type has
    # a form no other type can produce, so no two different values render alike.
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value) if value == value else "nan"  # every NaN is one key
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_render(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted((_render(k), _render(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "set[" + ",".join(sorted(_render(v) for v in value)) + "]"
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + bytes(value).hex()
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return f"{type(value).__name__}:{value.isoformat()}"
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return f"{type(value).__name__}:{value}"
    raise _Unrenderable(type(value).__qualname__)


def build_keys(parts: Sequence[KeyPart], arguments: Mapping[str, Any], call_args: Sequence[Any],
               call_kwargs: Mapping[str, Any], where: str, private: bool = False) -> List[str]:
    """Render each key part for one call; raise :class:`KeyBuildError` naming the template and argument.

    With ``private`` (hashed key names: the arguments must reach no log), the error names
    the exception's type but not its text, which may quote an argument, and does not
    chain it, as a traceback would print it.
    """
    keys = []
    for part in parts:
        if callable(part):
            try:
                value = part(*call_args, **call_kwargs)
            except Exception as exc:
                error = KeyBuildError(f"{where}: key callable {_name(part)} raised {_what(exc, private)}")
                raise error from (None if private else exc)
            if not isinstance(value, str):
                raise KeyBuildError(f"{where}: key callable {_name(part)} returned {type(value).__name__}, not str")
            keys.append(value)
            continue
        try:
            keys.append(_StableFormatter(where, part).vformat(part, (), arguments))
        except KeyBuildError:
            raise  # the formatter's own, which names the template already
        except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
            error = KeyBuildError(f"{where}: cannot build key {part!r} from the task's arguments: "
                                  f"{_what(exc, private)}")
            raise error from (None if private else exc)
    return keys


def _what(exc: Exception, private: bool) -> str:
    """An exception for an error message: its type, and its text unless ``private``."""
    if private:
        return f"{type(exc).__name__} (its text is left out: it may quote an argument, and key names are hashed)"
    return f"{type(exc).__name__}: {exc}"


#: What a rendering that names a memory address looks like (objects, functions, methods).
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


class _StableFormatter(string.Formatter):
    """``str.format`` that refuses a field whose text differs between two equal objects.

    An object without ``__str__`` renders as ``<Order object at 0x7f...>``: two calls
    for the same order would lock different keys and never exclude each other.
    """

    def __init__(self, where: str, template: str) -> None:
        self.where, self.template = where, template

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        value, used = super().get_field(field_name, args, kwargs)
        cls = type(value)
        text = str(value)
        unordered = _unordered(value)
        if unordered is not None:
            # Refused, not rendered canonically: a canonical rendering would change the key
            # such a template gave before, and old and new workers would not exclude each other.
            raise KeyBuildError(
                f"{self.where}: key {self.template!r} would render {{{field_name}}} with a {unordered} in it, "
                f"whose text follows its {'insertion' if unordered == 'dict' else 'hash'} order: two equal "
                f"values could give two keys that never exclude each other; name the fields that identify "
                f"the work (like {{{field_name}[id]}}), or leave key= out for the default key, which is canonical")
        if (cls.__str__ is object.__str__ and cls.__repr__ is object.__repr__) or _ADDRESS.search(text):
            raise KeyBuildError(
                f"{self.where}: key {self.template!r} would render {{{field_name}}} as {text[:60]!r}, which names "
                f"an object, not a value: two calls for the same {cls.__name__} would not exclude each other; "
                f"name a field that identifies it (like {{{field_name}.id}}) or give {cls.__name__} a __str__")
        return value, used


class _PathFormatter(_StableFormatter):
    """A key's formatter whose every field must stay inside one znode name."""

    def format_field(self, value: Any, format_spec: str) -> str:
        text = super().format_field(value, format_spec)
        if "/" in text:
            raise KeyBuildError(f"{self.where}: path {self.template!r} would render a field with a '/' in it: "
                                "a field names part of one znode, never another parent")
        return text


def _unordered(value: Any, depth: int = 0) -> Optional[str]:
    """The name of a mapping or set in ``value`` (itself, or inside a list or tuple), else None.

    >>> import types; _unordered(types.MappingProxyType({"id": 1})), _unordered([1, {2}]), _unordered("s")
    ('dict', 'set', None)
    """
    if isinstance(value, Mapping):  # dict, and any mapping that renders in its own order
        return "dict"
    if isinstance(value, (set, frozenset)):
        return "set"
    if isinstance(value, (list, tuple)) and depth < 20:
        for item in value:
            found = _unordered(item, depth + 1)
            if found is not None:
                return found
    return None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def check_znode_path(path: str, what: str, shown: Optional[str] = None) -> str:
    """``path`` if it is an absolute znode path ZooKeeper accepts, else ConfigurationError naming
    ``what``, and quoting ``shown`` (what the user wrote: a template) in place of ``path``.

    >>> check_znode_path("/billing/locks/invoice-42", "path")
    '/billing/locks/invoice-42'
    >>> check_znode_path("/billing/../x", "path")
    Traceback (most recent call last):
    ...
    celery_zklock.exceptions.ConfigurationError: path='/billing/../x' must be an absolute znode path ...
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (len(parts) < 2 or parts[0] != "" or any(p in ("", ".", "..") for p in parts[1:])
            or any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in path)):
        written = path if shown is None else shown
        raise ConfigurationError(f"{what}={written!r:.120} must be an absolute znode path (like "
                                 "/app/locks/invoice-42): no empty, '.' or '..' names, no trailing '/', no control "
                                 "characters")
    return path


def check_path_template(template: Any, fn: Optional[Callable[..., Any]], where: str) -> Optional[str]:
    """Validate a ``path=`` template (the znode to lock, as a Java service names it) when the
    task is defined, as key templates are: it names the task's arguments (or, for ``lock()``,
    ``fn`` None, only ``{key}``), and what is not a field is an absolute znode path already.

    >>> check_path_template("/billing/locks/invoice-{invoice_id}", lambda invoice_id: None, "task t")
    '/billing/locks/invoice-{invoice_id}'
    """
    if template is None:
        return None
    if not isinstance(template, str):
        raise ConfigurationError(f"{where}: path must be a str template, not {type(template).__name__}")
    if fn is None:
        try:
            roots = _template_roots(template)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: path template {template!r} is malformed: {exc}") from None
        if any(root != "key" for root in roots):
            raise ConfigurationError(f"{where}: path template {template!r} may name only {{key}}")
    else:
        try:
            check_key_parts(template, fn, where)
        except ConfigurationError as exc:  # the same checks: said of the path
            raise ConfigurationError(str(exc).replace(": key template", ": path template", 1)) from None
    # Checked with each field as "x", and said of the template as written.
    check_znode_path("".join(text + ("x" if field is not None else "")
                             for text, field, _, _ in string.Formatter().parse(template)), f"{where}: path", template)
    return template


def build_path(template: str, arguments: Mapping[str, Any], where: str) -> str:
    """Render a ``path=`` template for one call, as a key template is rendered, refusing a
    field whose text has a ``/`` in it (it would name another znode than the one meant).

    >>> build_path("/billing/locks/invoice-{invoice_id}", {"invoice_id": 42}, "task t")
    '/billing/locks/invoice-42'
    >>> build_path("/b/{key}", {"key": "a/b"}, "lock()")
    Traceback (most recent call last):
    ...
    celery_zklock.exceptions.KeyBuildError: lock(): path '/b/{key}' would render a field with a '/' in it: ...
    """
    try:
        path = _PathFormatter(where, template).vformat(template, (), arguments)
    except KeyBuildError:
        raise
    except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
        raise KeyBuildError(f"{where}: cannot build path {template!r} from the arguments: "
                            f"{type(exc).__name__}: {exc}") from None
    try:
        return check_znode_path(path, f"{where}: path")
    except ConfigurationError as exc:
        raise KeyBuildError(str(exc)) from None
