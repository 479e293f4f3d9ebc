"""``python -m tools.workloads SHAPE --requests N --seed S --out PATH [--duration-s D]
[--block-tokens B] [--PARAM VALUE ...]``: write a synthetic trace, print a one-line summary.

The trace is JSONL in the conversation trace's format (``--out -``: standard output, the summary
then on standard error). PARAM is any parameter of the shape, listed with its default by
``--help``; a mix also takes its components' as ``--docqa.documents 1000`` and its weights as
``--weights chat=0.5,scan=0.5``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tools.workloads.generate import SHAPES, SINGLE_SHAPES, generate
from tools.workloads.summary import summarize


def _defaults(shape: str) -> dict[str, Any]:
    instance = SHAPES[shape]()
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def _format(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v:g}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


def _parse(key: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, Mapping):
            pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError
            return {name.strip(): float(weight) for name, weight in pairs}
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        raise ValueError(f"--{key}: cannot read {text!r} as {_format(default)!r} is") from None
    raise ValueError(f"--{key} is not set from the command line; set its fields, as --{key}.PARAM")


def shape_params(shape: str, args: Sequence[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` pairs as typed parameters of ``shape``."""
    defaults = _defaults(shape)
    out: dict[str, Any] = {}
    items = list(args)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or len(flag) == 2:
            raise ValueError(f"expected --PARAM VALUE, got {flag!r}")
        key, eq, text = flag[2:].partition("=")
        if not eq:
            if not items:
                raise ValueError(f"{flag} needs a value")
            text = items.pop(0)
        key = key.replace("-", "_")
        component, dot, sub = key.partition(".")
        if dot and shape == "mix" and component in SINGLE_SHAPES and sub in _defaults(component):
            default = _defaults(component)[sub]
        elif not dot and key in defaults:
            default = defaults[key]
        else:
            raise ValueError(f"{shape} has no parameter {key!r} (--help lists them)")
        out[key] = _parse(key, text, default)
    return out


def _shapes_help() -> str:
    lines = ["shapes and their parameters (defaults; token counts are medians, docstrings in "
             "tools/workloads/shapes.py):"]
    for name in SHAPES:
        params = " ".join(f"{k}={_format(v)}" for k, v in _defaults(name).items()
                          if not dataclasses.is_dataclass(v))
        lines += textwrap.wrap(f"{name}: {params}", width=100, initial_indent="  ", subsequent_indent="    ")
    lines.append("  mix also takes each component's parameters as --SHAPE.PARAM (--docqa.documents 1000)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.workloads", description=__doc__.split("\n\n")[0],
                                     epilog=_shapes_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("--requests", type=int, required=True, help="how many requests")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", required=True, help="the JSONL trace to write, - for standard output")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="sessions start at the rate that brings about N requests in this many seconds "
                             "(the last sessions' later turns come after it)")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per block (default 512)")
    args, rest = parser.parse_known_args(argv)
    try:
        params = shape_params(args.shape, rest)
        records = generate(args.shape, args.requests, args.seed, duration_s=args.duration_s,
                           block_tokens=args.block_tokens, **params)
    except ValueError as e:
        parser.error(str(e))
    lines = "".join(json.dumps(r) + "\n" for r in records)
    if args.out == "-":
        sys.stdout.write(lines)
        report = sys.stderr
    else:
        Path(args.out).write_text(lines)
        report = sys.stdout
    print(summarize(records, args.block_tokens), file=report)
    return 0
