"""What agent code may contain: an AST policy checked before any code reaches the worker.

No imports, no names or attributes that lead out of the sandbox (dunders, private attributes, frame
and code objects, str.format's attribute lookups), no classes, no global/nonlocal, no async. The
worker adds restricted builtins and OS limits on top; this is the first of the layers.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

MAX_CODE_CHARS = 8000

BANNED_NAMES = frozenset({
    "open", "exec", "eval", "compile", "globals", "locals", "vars", "getattr", "setattr", "delattr",
    "__import__", "input", "breakpoint", "help", "exit", "quit", "memoryview", "type", "object", "super",
    "dir", "id", "classmethod", "staticmethod", "property", "__builtins__", "__loader__", "__spec__",
    "bytearray", "issubclass", "hasattr", "callable", "iter", "next", "aiter", "anext", "copyright",
    "credits", "license",
})
BANNED_ATTRS = frozenset({
    "format", "format_map", "mro", "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code",
    "ag_frame", "ag_code", "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "tb_frame",
    "tb_next", "co_code", "func_globals", "func_code", "im_func", "im_self",
})
BANNED_PREFIXES = ("_", "gi_", "cr_", "ag_", "f_", "tb_", "co_")


class PolicyError(ValueError):
    pass


@dataclass
class CodeInfo:
    defined: dict[str, str] = field(default_factory=dict)  # name -> source of top-level functions
    called: set[str] = field(default_factory=set)  # plain names called anywhere


# Every place the grammar writes an identifier (ast's `identifier` fields). An attribute path reads an
# attribute of an object: `x.attr` and a class pattern's keywords (`case int(__class__=c)` reads c = x.__class__).
ATTRIBUTE_FIELDS = {(ast.Attribute, "attr"), (ast.MatchClass, "kwd_attrs")}
# A name looked up (or assigned): no banned builtin, no dunder. A name only bound or given (a parameter, a
# keyword argument like `read(id=...)`, a pattern capture): no dunder.
NAME_FIELDS = {(ast.Name, "id")}
BINDING_FIELDS = {(ast.MatchAs, "name"), (ast.MatchStar, "name"), (ast.MatchMapping, "rest"), (ast.arg, "arg"),
                  (ast.keyword, "arg"), (ast.FunctionDef, "name"), (ast.ExceptHandler, "name"), (ast.alias, "name"),
                  (ast.alias, "asname")}


def _check_identifiers(node: ast.AST, line) -> None:
    """No identifier anywhere in the tree leads out: the fields are walked by type, not by example."""
    for field_name, value in ast.iter_fields(node):
        names = value if isinstance(value, list) else [value]
        names = [n for n in names if isinstance(n, str)]
        if not names or isinstance(node, (ast.Constant, ast.ImportFrom)) or field_name == "type_comment":
            continue
        if (type(node), field_name) in ATTRIBUTE_FIELDS:
            for n in names:
                if n in BANNED_ATTRS or n.startswith(BANNED_PREFIXES):
                    raise PolicyError(f"line {line}: attribute '{n}' is not available")
        elif (type(node), field_name) in NAME_FIELDS | BINDING_FIELDS:
            for n in names:
                if n.startswith("__") or (n in BANNED_NAMES and (type(node), field_name) in NAME_FIELDS):
                    raise PolicyError(f"line {line}: '{n}' is not available")
        else:  # an identifier field this table does not know (a newer Python's grammar): refuse, do not guess
            raise PolicyError(f"line {line}: {type(node).__name__}.{field_name} is not supported")


def check(code: str) -> CodeInfo:
    """Parse and check `code`; raises PolicyError naming the first offence (with its line)."""
    if len(code) > MAX_CODE_CHARS:
        raise PolicyError(f"code is {len(code)} characters; the limit is {MAX_CODE_CHARS}")
    try:
        tree = ast.parse(code, mode="exec")
    except SyntaxError as exc:
        raise PolicyError(f"syntax error at line {exc.lineno}: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError) as exc:
        raise PolicyError(f"cannot parse code: {type(exc).__name__}") from None
    info = CodeInfo()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        _check_identifiers(node, line)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            raise PolicyError(f"line {line}: imports are not allowed; use apis")
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            raise PolicyError(f"line {line}: global/nonlocal are not allowed")
        if isinstance(node, (ast.ClassDef, ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)):
            raise PolicyError(f"line {line}: classes and async code are not allowed")
        if isinstance(node, ast.Name) and (node.id in BANNED_NAMES or node.id.startswith("__")):
            raise PolicyError(f"line {line}: '{node.id}' is not available")
        if isinstance(node, ast.Attribute) and (node.attr in BANNED_ATTRS or node.attr.startswith(BANNED_PREFIXES)):
            raise PolicyError(f"line {line}: attribute '{node.attr}' is not available")
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                raise PolicyError(f"line {line}: function names may not start with '_'")
            for a in ast.walk(node.args):
                if isinstance(a, ast.arg) and a.arg.startswith("__"):
                    raise PolicyError(f"line {line}: argument '{a.arg}' is not allowed")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            info.called.add(node.func.id)
        if isinstance(node, (ast.ExceptHandler,)) and node.name and node.name.startswith("__"):
            raise PolicyError(f"line {line}: name '{node.name}' is not allowed")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            info.defined[node.name] = ast.get_source_segment(code, node) or ""
    return info
