"""The Jinja sandbox chat templates render in, and the per-row budget its hooks check. No torch.

NOTE: a template is compiled once (``compile_template``) into an immutable sandbox set up as
transformers sets up its own (``trim_blocks`` / ``lstrip_blocks``, ``loopcontrols``, the
``{% generation %}`` tag, its ``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``), with hooks that read the rendering row's ``RenderBudget`` (a context variable set
by ``within``; no budget, no checks):
  time   the deadline is checked at every step of every ``{% for %}`` loop (each loop's iterable
         is wrapped in ``environment.step_checked``, so loops with nothing inside count too), at
         every call (macros, methods, ``loop(...)`` recursion) and every piece of a macro's or
         block's output;
  size   each macro's or block's output, each ``~`` join and namespace value stops at the
         budget's ``max_chars``; ``+``, ``*``, ``**``, ``%``, the str methods and the filters
         that make a long text from a short one (``"a" * 10 ** 10``, ``center(10 ** 9)``,
         ``join``) are measured before they run, as they run in C where no deadline reaches.
Compiling runs under the budget too: Jinja evaluates constant filter calls while compiling, and
one the budget refuses is left to run (and fail) at render time. Jinja's ``lipsum`` global (a
Python loop of any length) is left out.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from batchgen_data.errors import RequestError

# Largest int a template may compute: 65,536 bits print as 19,729 digits, past Python's own
# 4,300-digit limit on printing one, and ``2 ** 10 ** 9`` would take minutes in C.
MAX_INT_BITS = 65_536
# Compiled templates kept (a job uses one or a few).
_CACHE_SIZE = 32
# Widths and precisions in a ``%`` or ``str.format`` format string.
_FORMAT_NUMBERS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?"  # printf: %(key)-08.3f
                             r"|\{[^{}]*?:[^{}\d]*(\d*)(?:[,_])?(?:\.(\d*))?")  # str.format: {0:>8.3}


@dataclass(slots=True, frozen=True)
class RenderBudget:
    """One row's rendering bounds: a deadline (``time.monotonic()``) and a size limit."""

    deadline: float
    time_limit_s: float  # for the message
    max_chars: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RequestError(f"chat template rendering took longer than {self.time_limit_s} s "
                               f"(the per-row limit)")

    def check_size(self, num_chars: int, what: str = "produced") -> None:
        """After output of ``num_chars`` characters."""
        if num_chars > self.max_chars:
            raise RequestError(f"chat template rendering {what} more than {self.max_chars:,} characters "
                               f"(the per-row limit)")

    def check_build(self, size: int, unit: str = "characters") -> None:
        """Before building a text of ``size`` characters (or a list of ``size`` items)."""
        if size > self.max_chars:
            kind = "text" if unit == "characters" else "list"
            raise RequestError(f"chat template rendering would build a {kind} of {size:,} {unit} "
                               f"(the per-row limit is {self.max_chars:,})")

    def check_ints(self, values) -> None:
        """Widths and counts (``center(n)``, ``batch(n)``, ``"%*d" % (n, 1)``) above the limit."""
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool):
                self.check_build(value)


# The rendering row's budget (None outside ``within``: no bounds).
_BUDGET: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


@contextlib.contextmanager
def within(budget: RenderBudget):
    """Compile and render under ``budget`` inside this block (this thread or task only)."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def compile_template(source: str):
    """``source`` as a ``jinja2.Template`` of the bounded sandbox (cached by source)."""
    from jinja2 import nodes

    environment = _environment_builder()()
    tree = environment.parse(source)
    for loop in tree.find_all(nodes.For):  # an environment attribute: a template cannot rebind it
        loop.iter = nodes.Call(nodes.EnvironmentAttribute("step_checked"), [loop.iter], [], None, None,
                               lineno=loop.iter.lineno)
    tree.set_environment(environment)
    return environment.from_string(tree)


# -- measuring before building -----------------------------------------------------------------


def _size(value: Any) -> int:
    """Characters of a text, items of a list or tuple (a list's texts count their characters)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(item) for item in value if isinstance(item, str))
    return 0


def _check_binop(budget: RenderBudget, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(seq, (str, list, tuple)):
                unit = "characters" if isinstance(seq, str) else "items"
                budget.check_build(_size(seq) * max(count, 0), unit)
        if isinstance(left, int) and isinstance(right, int):
            _check_int_bits(left.bit_length() + right.bit_length())
    elif operator == "+":
        budget.check_build(_size(left) + _size(right), "characters" if isinstance(left, str) else "items")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_int_bits(left.bit_length() * right)
    elif operator == "%" and isinstance(left, str):
        _check_format(budget, left)
        budget.check_ints(right if isinstance(right, (tuple, list)) else (right,))


def _check_int_bits(num_bits: int) -> None:
    if num_bits > MAX_INT_BITS:
        raise RequestError(f"chat template rendering would compute a {num_bits:,}-bit number "
                           f"(the limit is {MAX_INT_BITS:,} bits)")


def _check_format(budget: RenderBudget, text: str) -> None:
    """Widths and precisions of a ``%`` or ``str.format`` format string."""
    for match in _FORMAT_NUMBERS.finditer(text):
        budget.check_ints(int(n) for n in match.groups() if n)


def _check_str_method(budget: RenderBudget, method: Any, args: tuple, kwargs: dict) -> tuple:
    """Measure what a str method would build; returns its args (``join``'s items as a list)."""
    text, name = method.__self__, method.__name__
    budget.check_ints((*args, *kwargs.values()))
    if name == "join" and args:
        args = (list(args[0]), *args[1:])
        budget.check_build(_size(args[0]) + len(text) * max(len(args[0]) - 1, 0))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        budget.check_build(len(text) + count * len(args[1]))
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        budget.check_build(len(text) + text.count("\t") * (size if isinstance(size, int) else 0))
    elif name in ("format", "format_map"):
        _check_format(budget, text)
    return args


def _checked_filter(f):
    """A filter whose width / count arguments (``center(n)``, ``batch(n)``, ``indent(n)``) are
    checked against the budget, and ``join`` / ``replace`` / ``format`` measured, before it runs."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # the context or env, then the value

    @functools.wraps(f)
    def checked(*args, **kwargs):
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            budget.check_ints((*args[skip:], *kwargs.values()))
            value = args[skip - 1] if len(args) >= skip else None
            if f.__name__ == "do_join" and value is not None and not isinstance(value, str):
                items = list(value)
                separator = args[skip] if len(args) > skip else kwargs.get("d", "")
                budget.check_build(_size(items) + _size(separator) * max(len(items) - 1, 0))
                args = (*args[: skip - 1], items, *args[skip:])
            elif f.__name__ == "do_replace" and isinstance(value, str) and len(args) >= skip + 2:
                old, new = str(args[skip]), str(args[skip + 1])
                count = value.count(old) if old else len(value) + 1
                budget.check_build(len(value) + count * len(new))
            elif f.__name__ == "do_format" and isinstance(value, str):
                _check_format(budget, value)
        return f(*args, **kwargs)

    return checked


def _check_namespace_item(name: Any, value: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):  # as transformers' namespace
        from jinja2.exceptions import SecurityError

        raise SecurityError(f"a chat template cannot store underscore-prefixed attributes on a namespace, "
                            f"got {name!r}")
    budget = _BUDGET.get()
    if budget is not None:
        budget.check_time()
        budget.check_build(_size(value))


class _StepChecked:
    """A ``{% for %}`` loop's iterable that checks the row's deadline at every step (its length,
    for ``loop.length``, is the iterable's where it has one)."""

    __slots__ = ("_iterable", "_iterator", "_budget")

    def __init__(self, iterable: Any):
        self._iterable = iterable
        self._iterator = iter(iterable)
        self._budget = _BUDGET.get()

    def __iter__(self):
        return self

    def __next__(self):
        if self._budget is not None:
            self._budget.check_time()
        return next(self._iterator)

    def __len__(self) -> int:
        return len(self._iterable)  # a TypeError for an iterator: Jinja then counts the items


class _OutputBuffer(list):
    """A macro's or block's output pieces, within the row's deadline and size limit."""

    __slots__ = ("_budget", "_num_chars")

    def __init__(self):
        super().__init__()
        self._budget = _BUDGET.get()
        self._num_chars = 0

    def append(self, piece: Any) -> None:
        self._count((piece,))
        super().append(piece)

    def extend(self, pieces) -> None:
        pieces = tuple(pieces)
        self._count(pieces)
        super().extend(pieces)

    def _count(self, pieces: tuple) -> None:
        if self._budget is not None:
            self._num_chars += sum(len(p) for p in pieces if isinstance(p, str))
            self._budget.check_size(self._num_chars, "built a text of")
            self._budget.check_time()


# -- the sandbox -------------------------------------------------------------------------------


@functools.cache
def _environment_builder():
    """A function building the sandbox (its classes are made on first use: Jinja is imported only
    by engines that render a chat template)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """Output buffers (macros, ``{% set %}`` blocks, call blocks) and ``~`` joins that check
        the row's budget."""

        def buffer(self, frame) -> None:
            frame.buffer = self.temporary_identifier()
            self.writeline(f"{frame.buffer} = environment.output_buffer()")

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GenerationTag(Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's
        tokens for training masks): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class BoundedNamespace(jinja2.utils.Namespace):
        """``namespace()``: no underscore names, values within the budget."""

        def __init__(*args, **kwargs):  # Jinja's signature: ``self`` may be a keyword too
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name, value in attrs.items():
                _check_namespace_item(name, value)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_namespace_item(name, value)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            budget = _BUDGET.get()
            if budget is not None:
                _check_binop(budget, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            budget = _BUDGET.get()
            if budget is not None:
                budget.check_time()
                method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
                if isinstance(getattr(method, "__self__", None), str):
                    args = _check_str_method(budget, method, args, kwargs)
            return super().call(context, obj, *args, **kwargs)

        @staticmethod
        def step_checked(iterable):
            return _StepChecked(iterable)

        @staticmethod
        def output_buffer():
            return _OutputBuffer()

        @staticmethod
        def checked_concat(values):
            texts = [str(v) for v in values]
            budget = _BUDGET.get()
            if budget is not None:
                budget.check_build(sum(map(len, texts)))
            return "".join(texts)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_ints((indent,))
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def template_dict(*args, **kwargs):  # ``dict(...)`` without the type itself
        return dict(*args, **kwargs)

    template_dict.fromkeys = dict.fromkeys

    def strftime_now(format_):
        return datetime.now().strftime(format_)

    def build() -> BoundedEnvironment:
        environment = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[GenerationTag, loopcontrols])
        environment.filters = {name: _checked_filter(f) for name, f in environment.filters.items()}
        environment.filters["tojson"] = tojson
        environment.globals.pop("lipsum", None)
        environment.globals.update(raise_exception=raise_exception, dict=template_dict,
                                   namespace=BoundedNamespace, strftime_now=strftime_now)
        return environment

    return build
