"""What the Metal compiler rejects and g++ would accept: a source check of a kernel's header and body.

The emulator compiles MSL as C++14 with g++; these rules of the Metal Shading Language (MSL
specification §1.4.4 "Restrictions" and the address-space rules of §4) have no g++ flag, so they are
checked on the text before it is compiled, and a violation is an EmuCompileError naming the kernel,
the part (header or source) and the line:

- `double` (Metal has no 64-bit float; the emulator also poisons the identifier after its prelude);
- a pointer or reference declared (or cast to) without an address space — device, constant,
  threadgroup, thread (or threadgroup_imageblock, ray_data, object_data): `float *p`,
  `const uint& n`, `(float *)q`;
- recursion: a cycle in the call graph of the functions that the header and the body define
  (macros are nodes too, so a call through a macro counts; overloads of one name are one node);
- the C++ features MSL leaves out: new, delete, goto, virtual, throw/try/catch, dynamic_cast,
  typeid, thread_local, register, noexcept, lambda expressions, derived classes, the C++ standard
  library (`std::`, an #include other than <metal_stdlib>).

Not covered: recursion through function pointers or template instantiations of a different name
(no function pointers are in the sources), pointer declarations whose pointee is not a scalar or
vector type, a struct, typedef or template parameter named in the text (e.g. `decltype(x)* p`),
and anything a macro builds by token pasting.
"""
from __future__ import annotations

import dataclasses
import functools
import re

_TOKEN = re.compile(r"""
   (?P<ws>[ \t\r\f\v]+)
  |(?P<nl>\n)
  |(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  |(?P<num>\.?\d(?:[\w.]|[eEpP][+-])*)
  |(?P<id>[A-Za-z_]\w*)
  |(?P<op>::|->|&&|\|\||<<=|>>=|<<|>>|<=|>=|==|!=|\+\+|--|[-+*/%&|^!~<>=?:;,.()\[\]{}#\\])
""", re.X)

_SCALARS = ("bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "float")
BUILTIN_TYPES = (set(_SCALARS) | {s + n for s in _SCALARS for n in "234"}
                 | {"packed_" + s + n for s in _SCALARS for n in "234"}
                 | {"void", "size_t", "ptrdiff_t", "signed", "unsigned", "int8_t", "uint8_t", "int16_t",
                    "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t", "atomic_int", "atomic_uint"})
ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data",
                  "object_data"}
_DECL_QUALIFIERS = ADDRESS_SPACES | {"const", "volatile", "static", "inline", "constexpr", "signed",
                                     "unsigned", "typename"}
_DECL_CONTEXT = {"(", ",", ";", "{", "}", "<", None}
FORBIDDEN = {
    "double": "`double` (Metal has no 64-bit floating point)",
    "new": "the new operator", "delete": "the delete operator", "goto": "goto",
    "virtual": "virtual functions", "throw": "exceptions", "try": "exceptions", "catch": "exceptions",
    "dynamic_cast": "dynamic_cast", "typeid": "type identification (typeid)",
    "thread_local": "thread_local storage", "register": "the register storage class",
    "noexcept": "noexcept",
}
_NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "catch", "static_assert"}


@dataclasses.dataclass(frozen=True)
class Violation:
    part: str          # "header" or "source"
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.part} line {self.line}: {self.what}"


@dataclasses.dataclass
class _Tok:
    kind: str
    text: str
    line: int
    part: str


def _strip_comments(text: str) -> str:
    """Comments replaced by spaces (newlines kept, so line numbers stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text[i] in "\"'":
            m = _TOKEN.match(text, i)
            if m is None or m.lastgroup != "str":
                out.append(text[i]); i += 1
            else:
                out.append(m.group()); i = m.end()
        else:
            out.append(text[i]); i += 1
    return "".join(out)


def _tokens(text: str, part: str) -> tuple[list[_Tok], list[tuple[int, list[_Tok]]]]:
    """(code tokens, [(line, tokens of one preprocessor directive)])."""
    code, directives = [], []
    lines = _strip_comments(text).split("\n")
    k = 0
    while k < len(lines):
        line, first = lines[k], k + 1
        if line.lstrip().startswith("#"):
            body = line
            while body.endswith("\\") and k + 1 < len(lines):
                k += 1
                body = body[:-1] + " " + lines[k]
            directives.append((first, _lex(body, first, part)))
        else:
            code.extend(_lex(line, first, part))
        k += 1
    return code, directives


def _lex(s: str, line: int, part: str) -> list[_Tok]:
    out, i = [], 0
    while i < len(s):
        m = _TOKEN.match(s, i)
        if m is None:
            out.append(_Tok("op", s[i], line, part)); i += 1
            continue
        if m.lastgroup not in ("ws", "nl"):
            out.append(_Tok(m.lastgroup, m.group(), line, part))
        i = m.end()
    return out


def _declared_types(toks: list[_Tok], extra) -> set[str]:
    names = set(BUILTIN_TYPES) | set(extra)
    for i, t in enumerate(toks):
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.text in ("struct", "class", "union", "enum", "typename") and nxt is not None and nxt.kind == "id":
            names.add(nxt.text)
        elif t.text == "using" and nxt is not None and nxt.kind == "id" and i + 2 < len(toks) and toks[i + 2].text == "=":
            names.add(nxt.text)
        elif t.text == "typedef":
            j = i + 1
            while j < len(toks) and toks[j].text != ";":
                j += 1
            if toks[j - 1].kind == "id":
                names.add(toks[j - 1].text)
    return names


def _pointer_violations(toks: list[_Tok], types: set[str]) -> list[Violation]:
    out = []
    for i, t in enumerate(toks):
        if t.text not in ("*", "&", "&&") or i == 0:
            continue
        j = i - 1
        while j >= 0 and toks[j].text in ("const", "volatile"):
            j -= 1
        if j < 0 or toks[j].text not in types:
            continue
        k, spaces = j - 1, False
        while k >= 0 and toks[k].text in _DECL_QUALIFIERS:
            spaces |= toks[k].text in ADDRESS_SPACES
            k -= 1
        before = toks[k].text if k >= 0 else None
        if before in _DECL_CONTEXT and not spaces:
            decl = " ".join(x.text for x in toks[k + 1:i + 2])
            out.append(Violation(t.part, t.line, f"`{decl}`: a pointer or reference without an address space "
                                                 "(device, constant, threadgroup or thread); Metal requires one"))
    return out


def _feature_violations(toks: list[_Tok], directives) -> list[Violation]:
    out = []
    for i, t in enumerate(toks):
        nxt = toks[i + 1].text if i + 1 < len(toks) else None
        if t.kind == "id" and t.text in FORBIDDEN:
            out.append(Violation(t.part, t.line, f"{FORBIDDEN[t.text]} is not available in Metal"))
        elif t.text == "std" and nxt == "::":
            out.append(Violation(t.part, t.line, "the C++ standard library (std::) is not available in Metal"))
        elif t.text == "[" and nxt in ("]", "&", "="):
            prev = toks[i - 1] if i else None
            if prev is None or prev.kind not in ("id", "num") and prev.text not in (")", "]"):
                out.append(Violation(t.part, t.line, "lambda expressions are not available in Metal"))
        elif (t.text in ("struct", "class") and i + 2 < len(toks) and toks[i + 1].kind == "id"
              and toks[i + 2].text == ":" and (i == 0 or toks[i - 1].text != "enum")):
            out.append(Violation(t.part, t.line, f"derived classes ({t.text} {toks[i + 1].text} : ...) are not "
                                                 "available in Metal"))
    for line, d in directives:
        words = [x.text for x in d]
        if "double" in words:
            out.append(Violation(d[0].part, line, FORBIDDEN["double"] + " is not available in Metal"))
        if len(words) > 1 and words[1] == "include" and "".join(words[2:]) != "<metal_stdlib>":
            out.append(Violation(d[0].part, line, f"#include {''.join(words[2:])}: only <metal_stdlib> exists in Metal"))
    return out


def _call_graph(toks: list[_Tok], directives) -> dict[str, tuple[_Tok, set[str]]]:
    """name -> (token of its definition, identifiers its body (or macro body) names)."""
    graph: dict[str, tuple[_Tok, set[str]]] = {}
    for _line, d in directives:
        if len(d) > 2 and d[1].text == "define" and d[2].kind == "id":
            name, refs = d[2], {x.text for x in d[3:] if x.kind == "id"}
            graph.setdefault(name.text, (name, set()))[1].update(refs)
    i, n = 0, len(toks)
    while i < n:
        t = toks[i]
        if (t.kind == "id" and t.text not in _NOT_FUNCTIONS and i + 1 < n and toks[i + 1].text == "("
                and (i == 0 or toks[i - 1].text not in (".", "->"))):
            j, depth = i + 1, 0
            while j < n:                                  # the matching ')'
                depth += toks[j].text == "("
                depth -= toks[j].text == ")"
                if depth == 0:
                    break
                j += 1
            k = j + 1
            while k < n and toks[k].text in ("const", "volatile"):
                k += 1
            if k < n and toks[k].text == "{":
                end, depth = k, 0
                while end < n:                            # the body's matching '}'
                    depth += toks[end].text == "{"
                    depth -= toks[end].text == "}"
                    if depth == 0:
                        break
                    end += 1
                refs = {x.text for x in toks[k + 1:end] if x.kind == "id"}
                graph.setdefault(t.text, (t, set()))[1].update(refs)
                i = k + 1                                 # definitions nested in the body count too
                continue
        i += 1
    return graph


def _cycle(graph) -> list[str] | None:
    edges = {f: sorted(r & graph.keys()) for f, (_, r) in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(f):
        state[f] = 1
        path.append(f)
        for g in edges[f]:
            if state.get(g) == 1:
                return path[path.index(g):] + [g]
            if g not in state:
                found = visit(g)
                if found:
                    return found
        path.pop()
        state[f] = 2
        return None

    for f in sorted(edges):
        if f not in state:
            found = visit(f)
            if found:
                return found
    return None


@functools.lru_cache(maxsize=512)
def check(header: str, source: str, template_types: tuple[str, ...] = ()) -> tuple[Violation, ...]:
    """Every violation of the rules above in a kernel's header and body (empty when it is fine)."""
    htoks, hdirs = _tokens(header, "header")
    stoks, sdirs = _tokens(source, "source")
    toks, dirs = htoks + stoks, hdirs + sdirs
    types = _declared_types(toks, template_types)
    found = _feature_violations(toks, dirs) + _pointer_violations(toks, types)
    cycle = _cycle(_call_graph(toks, dirs))
    if cycle:
        graph = _call_graph(toks, dirs)
        first = graph[cycle[0]][0]
        found.append(Violation(first.part, first.line, "recursion (" + " -> ".join(cycle)
                               + "): Metal has no recursive calls"))
    return tuple(sorted(set(found), key=lambda v: (v.part != "header", v.line, v.what)))
