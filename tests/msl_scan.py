"""A type-aware scan of the Metal sources for fp32 arithmetic operators (tests/backends/test_metal_source.py).

The Metal backend keeps every fp32 `+ - * /` inside the contract header's primitive helpers, one
operator per statement, so that no result depends on whether the compiler honours
`#pragma METAL fp contract(off)` (DESIGN.md §11: MLX's safe math mode still contracts `a*b + c`
within one expression). This module finds those operators. It parses the subset of MSL the sources
use — declarations, casts, calls, subscripts, members, `as_type<T>`, the ternary, `for`/`while`/
`if`, `struct`s, inline functions, object-like and function-like `#define`s (expanded with the
argument types at each use) — with a precedence-climbing expression parser, and types each
operand as float ('f'), integer ('i') or unknown ('u'):

- declared names have their declared type (block scoped); the header's functions their return
  types; `float` literals, `O1B_F(...)`, `as_type<float>` and `(float)` casts are float;
- a name the source never declares is a kernel buffer or a template argument (the signature is
  written by mx.fast.metal_kernel from the call): the template names are those of the kernel's
  `template=` lists in metal/ops.py (integers), the buffers those of its entry in ops.KERNELS
  (`signatures`), whatever their case; a name that is neither is an error. A buffer element is
  unknown, except inside a subscript, whose operand MSL requires to be integral. Without a
  signature every undeclared name counts as a buffer;
- an arithmetic operator with a float or an unknown operand counts as an fp32 operator (an unknown
  buffer element is assumed to be fp32: a kernel that does integer arithmetic on one must name its
  type first, `long t = tok[i];`).

`scan(text, header_text)` returns every statement with its fp32 operators; the rules themselves are
in the test.
"""
from __future__ import annotations

import ast
import dataclasses
import re

TOKEN = re.compile(r"""
   (?P<ws>\s+)
  |(?P<str>"(?:[^"\\]|\\.)*")
  |(?P<num>0[xX][0-9a-fA-F]*(?:\.[0-9a-fA-F]*)?(?:[pP][+-]?\d+)?[uUlLfF]*
          |(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[uUlLfFhH]*)
  |(?P<id>[A-Za-z_]\w*)
  |(?P<op><<=|>>=|<<|>>|\+\+|--|\+=|-=|\*=|/=|%=|&=|\|=|\^=|==|!=|<=|>=|&&|\|\||->|::
          |[-+*/%&|^~!<>=?:;,.()\[\]{}])
""", re.X)

FLOAT_TYPES = {"float", "half", "float2", "float3", "float4"}
INT_TYPES = {"int", "uint", "long", "ulong", "short", "ushort", "char", "uchar", "bool", "size_t",
             "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t",
             "uint2", "uint3", "int2", "int3", "void"}
QUALIFIERS = {"const", "constexpr", "static", "thread", "device", "threadgroup", "constant", "inline",
              "volatile", "unsigned", "signed"}
ARITH = {"+", "-", "*", "/"}
COMPOUND = {"+=": "+", "-=": "-", "*=": "*", "/=": "/"}
BINARY_PREC = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="),
               ("<<", ">>"), ("+", "-"), ("*", "/", "%")]
PREC = {op: i + 3 for i, ops in enumerate(BINARY_PREC) for op in ops}     # 1 assignment, 2 ternary
ASSIGN = {"=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="}


@dataclasses.dataclass
class Tok:
    kind: str
    text: str
    line: int


@dataclasses.dataclass
class Statement:
    """One statement (or #define body): where it is, its text, and its fp32 operators."""
    line: int
    function: str | None          # the enclosing function of the header; None in a kernel body
    text: str
    float_ops: list               # [(operator, line)]
    is_define: bool = False


class ParseError(ValueError):
    pass


def strip_comments(text: str) -> str:
    out = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", out)


def split_preprocessor(text: str) -> tuple[list[tuple[int, str]], str]:
    """(directives as (line, text), the code with directive lines blanked)."""
    lines = text.split("\n")
    directives, i = [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("#"):
            start, d = i, lines[i]
            lines[i] = ""
            while d.endswith("\\") and i + 1 < len(lines):
                i += 1
                d = d[:-1] + " " + lines[i]
                lines[i] = ""
            directives.append((start + 1, d.strip()))
        i += 1
    return directives, "\n".join(lines)


def tokenize(text: str, line0: int = 1) -> list[Tok]:
    toks, pos, line = [], 0, line0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"line {line}: cannot tokenize {text[pos:pos + 20]!r}")
        kind = m.lastgroup
        if kind != "ws":
            toks.append(Tok(kind, m.group(0), line))
        line += m.group(0).count("\n")
        pos = m.end()
    return toks


def literal_type(text: str) -> str:
    t = text.lower()
    if t.startswith("0x"):
        return "f" if "p" in t or "." in t else "i"
    return "f" if ("." in t or "e" in t or t.endswith("f") or t.endswith("h")) else "i"


def join(a: str, b: str) -> str:
    if "f" in (a, b):
        return "f"
    if "u" in (a, b):
        return "u"
    return "i"


def base_type(name: str, structs: dict) -> str | None:
    if name in FLOAT_TYPES:
        return "f"
    if name in INT_TYPES:
        return "i"
    if name in structs:
        return name
    return None


@dataclasses.dataclass
class Macro:
    params: list | None            # None: object-like
    body: list                     # tokens


class Scanner:
    """Parses declarations, functions and statements; collects Statements."""

    def __init__(self, functions=None, structs=None, macros=None, templates=(), buffers=None):
        self.functions: dict[str, str] = dict(functions or {})     # name -> return type
        self.structs: dict[str, dict] = dict(structs or {})        # name -> {field: type}
        self.macros: dict[str, Macro] = dict(macros or {})
        self.templates = frozenset(templates)                       # template integer arguments
        self.buffers = None if buffers is None else frozenset(buffers)    # None: any undeclared name
        self.scopes: list[dict] = [{}]
        self.statements: list[Statement] = []
        self.function: str | None = None
        self._ops: list | None = None
        self._sub = 0                                               # subscript depth

    # ------------------------------------------------------------------ names
    def lookup(self, name: str) -> str | None:
        for s in reversed(self.scopes):
            if name in s:
                return s[name]
        return None

    def declare(self, name: str, typ: str) -> None:
        self.scopes[-1][name] = typ

    # ------------------------------------------------------------------ token stream
    def run(self, toks: list[Tok]) -> None:
        self.toks, self.i = toks, 0

    def peek(self, k: int = 0) -> Tok | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def at(self, *texts) -> bool:
        t = self.peek()
        return t is not None and t.text in texts

    def next(self) -> Tok:
        t = self.peek()
        if t is None:
            raise ParseError("unexpected end of source")
        self.i += 1
        return t

    def expect(self, text: str) -> Tok:
        t = self.next()
        if t.text != text:
            raise ParseError(f"line {t.line}: expected {text!r}, got {t.text!r}")
        return t

    # ------------------------------------------------------------------ types of declarations
    def type_at(self, k: int = 0) -> tuple[str, int] | None:
        """(type, tokens it spans) when a declaration's type starts at offset k."""
        j = k
        while (t := self.peek(j)) is not None and t.text in QUALIFIERS:
            j += 1
        t = self.peek(j)
        if t is None or t.kind != "id":
            return None
        typ = base_type(t.text, self.structs)
        if typ is None:
            return None
        j += 1
        while (t := self.peek(j)) is not None and t.text in ("*", "&"):
            j += 1
        return typ, j - k

    def is_declaration(self) -> bool:
        ty = self.type_at()
        if ty is None:
            return False
        t = self.peek(ty[1])
        return t is not None and t.kind == "id"

    # ------------------------------------------------------------------ top level
    def top_level(self) -> None:
        while self.peek() is not None:
            if self.at("using"):
                while not self.at(";"):
                    self.next()
                self.next()
            elif self.at("struct"):
                self.struct()
            elif self.is_declaration() and self._is_function():
                self.function_def()
            else:
                self.statement()

    def _is_function(self) -> bool:
        _, n = self.type_at()
        t1, t2 = self.peek(n), self.peek(n + 1)
        return t1 is not None and t1.kind == "id" and t2 is not None and t2.text == "("

    def struct(self) -> None:
        self.expect("struct")
        name = self.next().text
        self.structs[name] = fields = {}
        self.expect("{")
        while not self.at("}"):
            typ, n = self.type_at()
            self.i += n
            while True:
                fields[self.next().text] = typ
                if self.at(","):
                    self.next()
                    continue
                break
            self.expect(";")
        self.expect("}")
        self.expect(";")

    def function_def(self) -> None:
        typ, n = self.type_at()
        self.i += n
        name = self.next().text
        self.functions[name] = typ
        self.expect("(")
        self.scopes.append({})
        while not self.at(")"):
            ptyp, pn = self.type_at()
            self.i += pn
            self.declare(self.next().text, ptyp)
            if self.at(","):
                self.next()
        self.expect(")")
        self.function = name
        self.block()
        self.function = None
        self.scopes.pop()

    # ------------------------------------------------------------------ statements
    def block(self) -> None:
        self.expect("{")
        self.scopes.append({})
        while not self.at("}"):
            self.statement()
        self.expect("}")
        self.scopes.pop()

    def _begin(self) -> tuple[int, int]:
        self._ops = []
        return self.i, self.peek().line

    def _end(self, start: int, line: int) -> None:
        text = " ".join(t.text for t in self.toks[start:self.i])
        self.statements.append(Statement(line, self.function, text, self._ops))
        self._ops = None

    def statement(self) -> None:
        t = self.peek()
        if t.text == "{":
            self.block()
        elif t.text == "if" or t.text == "while":
            self.next()
            self.expect("(")
            s = self._begin()
            self.expr()
            self._end(*s)
            self.expect(")")
            self.statement()
            if t.text == "if" and self.at("else"):
                self.next()
                self.statement()
        elif t.text == "for":
            self.next()
            self.expect("(")
            self.scopes.append({})
            for stop in (";", ";", ")"):
                s = self._begin()
                if not self.at(stop):
                    if stop == ";" and self.is_declaration():
                        self.declaration()
                    else:
                        self.expr()
                self._end(*s)
                self.expect(stop)
            self.statement()
            self.scopes.pop()
        elif t.text in ("return", "break", "continue"):
            s = self._begin()
            self.next()
            if not self.at(";"):
                self.expr()
            self._end(*s)
            self.expect(";")
        elif t.text == "static_assert":
            while not self.at(";"):
                self.next()
            self.next()
        elif t.text == ";":
            self.next()
        else:
            s = self._begin()
            if self.is_declaration():
                self.declaration()
            else:
                self.expr()
            self._end(*s)
            self.expect(";")

    def declaration(self) -> None:
        typ, n = self.type_at()
        self.i += n
        while True:
            name = self.next().text
            while self.at("["):
                self.next()
                self._sub += 1
                self.expr()
                self._sub -= 1
                self.expect("]")
            if self.at("="):
                self.next()
                self.expr(2)
            self.declare(name, typ)
            if self.at(","):
                self.next()
                continue
            break

    # ------------------------------------------------------------------ expressions
    def _count(self, op: str, a: str, b: str, line: int) -> None:
        if op in ARITH and join(a, b) in ("f", "u") and not (self._sub and "f" not in (a, b)):
            if self._ops is not None:
                self._ops.append((op, line))

    def expr(self, min_prec: int = 0) -> str:
        left = self.unary()
        while True:
            t = self.peek()
            if t is None:
                return left
            op = t.text
            if op in ASSIGN and min_prec <= 1:
                self.next()
                right = self.expr(1)
                if op in COMPOUND:
                    self._count(COMPOUND[op], left, right, t.line)
                continue
            if op == "?" and min_prec <= 2:
                self.next()
                a = self.expr(0)
                self.expect(":")
                b = self.expr(2)
                left = join(a, b)
                continue
            p = PREC.get(op)
            if p is None or p < min_prec or t.kind != "op":
                return left
            self.next()
            right = self.expr(p + 1)
            self._count(op, left, right, t.line)
            if op in ARITH or op == "%":
                left = join(left, right)
                if self._sub and left == "u":
                    left = "i"
            else:
                left = "i"

    def unary(self) -> str:
        t = self.peek()
        if t.text in ("-", "+"):
            self.next()
            return self.unary()
        if t.text in ("!", "~"):
            self.next()
            self.unary()
            return "i"
        if t.text in ("++", "--"):
            self.next()
            typ = self.unary()
            self._count(t.text[0], typ, "i", t.line)
            return typ
        if t.text == "(":
            ty = self.type_at(1)
            if ty is not None and self.peek(1 + ty[1]) is not None and self.peek(1 + ty[1]).text == ")":
                self.i += 2 + ty[1]                                  # a cast
                self.unary()
                return ty[0]
        return self.postfix()

    def postfix(self) -> str:
        typ = self.primary()
        while True:
            t = self.peek()
            if t is None:
                return typ
            if t.text == "[":
                self.next()
                self._sub += 1
                self.expr()
                self._sub -= 1
                self.expect("]")
                typ = "i" if self._sub and typ == "u" else typ
            elif t.text == ".":
                self.next()
                field = self.next().text
                typ = self.structs.get(typ, {}).get(field, "i" if field in ("x", "y", "z") else "u")
            elif t.text in ("++", "--"):
                self.next()
                self._count(t.text[0], typ, "i", t.line)
            else:
                return typ

    def args(self) -> list:
        self.expect("(")
        out = []
        while not self.at(")"):
            out.append(self.expr(2))
            if self.at(","):
                self.next()
        self.expect(")")
        return out

    def primary(self) -> str:
        t = self.next()
        if t.kind == "num":
            return literal_type(t.text)
        if t.kind == "str":
            return "i"
        if t.text == "(":
            typ = self.expr()
            self.expect(")")
            return typ
        if t.kind != "id":
            raise ParseError(f"line {t.line}: unexpected {t.text!r}")
        name = t.text
        if name in ("true", "false"):
            return "i"
        if self.at("::"):                              # a scoped enumerator: mem_flags::mem_threadgroup
            self.next()
            self.next()
            return "i"
        if name == "as_type" and self.at("<"):
            self.next()
            typ = base_type(self.next().text, self.structs) or "u"
            self.expect(">")
            self.args()
            return typ
        if self.at("(") and base_type(name, self.structs) is not None:    # constructor-style cast
            self.args()
            return base_type(name, self.structs)
        if name in self.macros:
            return self.expand(name, t.line)
        if self.at("("):
            self.args()
            return self.functions.get(name, "u")
        typ = self.lookup(name)
        if typ is not None:
            return typ
        if name in self.templates:
            return "i"                                                   # a template integer
        if name.startswith(("thread", "threadgroup_position", "threads_", "grid_", "simd", "quadgroup",
                            "dispatch_")):
            return "i"                                                   # a thread attribute
        if self.buffers is not None and name not in self.buffers:
            raise ParseError(f"line {t.line}: {name!r} is not declared, not a buffer of the kernel "
                             f"({sorted(self.buffers)}) and not a template argument ({sorted(self.templates)})")
        return "i" if self._sub else "u"                                 # a buffer (element)

    def expand(self, name: str, line: int) -> str:
        """The type of a macro use: its body parsed with the parameters bound to the argument types
        (operators in the body count at the use)."""
        m = self.macros[name]
        bind = {}
        if m.params is not None:
            types = self.args()
            bind = dict(zip(m.params, types))
        sub = Scanner(self.functions, self.structs, self.macros, self.templates, self.buffers)
        sub.scopes = [dict(self.lookup_all()), bind]
        sub._sub = self._sub
        sub._ops = []
        sub.run(m.body)
        typ = sub.expr()
        if self._ops is not None:
            self._ops.extend((op, line) for op, _ in sub._ops)
        return typ

    def lookup_all(self) -> dict:
        out = {}
        for s in self.scopes:
            out.update(s)
        return out


def parse_defines(directives, scanner: Scanner, collect: bool) -> None:
    """Record each #define as a macro; with collect, also list its body as a Statement (its
    parameters typed unknown)."""
    for line, d in directives:
        m = re.match(r"#\s*define\s+(\w+)(\(([^)]*)\))?\s*(.*)$", d)
        if not m:
            continue
        name, params, body = m.group(1), m.group(3), m.group(4)
        plist = [p.strip() for p in params.split(",")] if m.group(2) is not None else None
        toks = tokenize(body, line)
        scanner.macros[name] = Macro(plist, toks)
        if collect and toks:
            sub = Scanner(scanner.functions, scanner.structs, scanner.macros, scanner.templates)
            sub.scopes = [{p: "u" for p in (plist or [])}]
            sub._ops = []
            sub.run(toks)
            try:
                sub.expr()
            except ParseError:
                pass
            scanner.statements.append(Statement(line, None, d, sub._ops, is_define=True))


def scan_header(text: str) -> Scanner:
    """Parse the contract header: its functions, structs, macros and statements."""
    directives, code = split_preprocessor(strip_comments(text))
    sc = Scanner()
    parse_defines(directives, sc, collect=True)
    sc.run(tokenize(code))
    sc.top_level()
    return sc


def scan_kernel(text: str, header: Scanner, templates=(), buffers=None) -> Scanner:
    """Parse a kernel body (the text given to mx.fast.metal_kernel as `source`) with the header's
    functions, structs and macros known, and the kernel's signature: its template argument names
    and its buffer names (None: every undeclared name is taken for a buffer)."""
    directives, code = split_preprocessor(strip_comments(text))
    sc = Scanner(header.functions, header.structs, header.macros, templates, buffers)
    parse_defines(directives, sc, collect=True)
    sc.run(tokenize(code))
    sc.top_level()
    return sc


def signatures(ops_text: str) -> dict[str, tuple[list, set]]:
    """{kernel: (buffer names, template names)} from the source of metal/ops.py: the buffers of its
    KERNELS table (inputs and outputs), the template names of every `template=[("NAME", ...), ...]`
    list passed where the kernel is launched (the call's first argument, a kernel name, or a
    parameter of the enclosing function given kernel names by its callers). A template list that
    cannot be tied to a kernel is an error, so none is missed."""
    tree = ast.parse(ops_text)
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "KERNELS" for t in n.targets))
    kernels = ast.literal_eval(table)
    out = {name: ([*ins, *outs], set()) for name, (ins, outs) in kernels.items()}
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    parents = {c: f for f in functions.values() for c in ast.walk(f)}

    def kernel_names(arg, where) -> list:
        if isinstance(arg, ast.Constant) and arg.value in out:
            return [arg.value]
        f = parents.get(where)
        params = [a.arg for a in f.args.args] if f is not None else []
        if isinstance(arg, ast.Name) and arg.id in params:
            k = params.index(arg.id)
            names = [c.args[k].value for c in ast.walk(tree) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Name) and c.func.id == f.name and len(c.args) > k
                     and isinstance(c.args[k], ast.Constant)]
            if names and all(n in out for n in names):
                return names
        raise ValueError(f"metal/ops.py line {where.lineno}: a template list whose kernel is not a kernel name "
                         f"or a parameter its callers give kernel names: {ast.unparse(where)[:80]}")

    for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
        tmpl = next((k.value for k in call.keywords if k.arg == "template"), None)
        if tmpl is None or (isinstance(tmpl, ast.Name) and tmpl.id == "template"):
            continue                                     # absent, or passed through (_pointwise)
        if not isinstance(tmpl, ast.List) or not call.args:
            raise ValueError(f"metal/ops.py line {call.lineno}: template= is not a list literal: "
                             f"{ast.unparse(call)[:80]}")
        names = {ast.literal_eval(e.elts[0]) for e in tmpl.elts}
        for k in kernel_names(call.args[0], call):
            out[k][1].update(names)
    return out
