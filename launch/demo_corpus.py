"""Build the demo conversation dataset from Python's own standard library.

The demo verifier and the demo drafter need text whose next-token distributions
are structured (not near-uniform) and that anyone can rebuild offline. Python's
standard library ships with every interpreter: its documented functions give
code (highly predictable once a few tokens are known) and docstrings (English
prose), which we turn into chat conversations:

* ``write``:   user asks for a named function of a module, assistant answers with
  its source in a fenced code block;
* ``explain``: user pastes a function without its docstring, assistant answers
  with the docstring text;
* ``multi``:   a ``write`` turn followed by a second user request for another
  function of the same module (two assistant turns).

Output (JSONL, one conversation per line, ``{"id", "kind", "conversations": [
{"role", "content"}, ...]}``): ``conversations.jsonl`` (training) and
``conversations_heldout.jsonl`` (5%, never seen by the demo verifier), plus
``corpus_manifest.json`` naming the interpreter and the sha256 of every source
file read, so that a rebuild on another Python version is detectable.

    python -m launch.demo_corpus --out configs/demo

Deterministic for a given interpreter version (sorted files, seeded RNG).
The standard library is distributed under the PSF license.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
import textwrap
from pathlib import Path

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a Python expert. Answer with code when asked for code.",
    "You are a concise assistant that knows the Python standard library.",
]

WRITE_TEMPLATES = [
    "Write the function `{qual}{sig}` from Python's `{module}` module.\n{summary}",
    "Show me the implementation of `{qual}` in the `{module}` module.",
    "How is `{module}.{qual}` implemented? Please give the code.",
    "Implement `{qual}{sig}` as it appears in `{module}`. It should do this: {summary}",
]

EXPLAIN_TEMPLATES = [
    "What does this function from `{module}` do?\n```python\n{code}\n```",
    "Explain the following code.\n```python\n{code}\n```",
    "Write a docstring for this function:\n```python\n{code}\n```",
]

FOLLOWUP_TEMPLATES = [
    "Now show `{qual}` from the same module.",
    "Thanks. And how is `{qual}` written?",
    "Next, write `{qual}{sig}`.",
]

ANSWER_PREFIXES = ["", "Here is the implementation:\n", "Sure.\n", "Here it is:\n"]


def stdlib_files(stdlib: Path) -> list[Path]:
    """Top-level modules of the standard library, sorted by name."""
    return sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("__"))


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"({args})"


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def _strip_docstring(lines: list[str], node, offset: int) -> list[str]:
    """Remove the docstring statement (lines of node.body[0]) from ``lines``."""
    doc_node = node.body[0]
    start = doc_node.lineno - 1 - offset
    end = doc_node.end_lineno - offset
    out = lines[:start] + lines[end:]
    # a function whose only statement was the docstring keeps a body
    if len(node.body) == 1:
        indent = re.match(r"\s*", lines[start]).group(0)
        out.insert(start, indent + "...")
    return out


def extract_functions(path: Path, max_lines: int = 40, max_chars: int = 1600) -> list[dict]:
    """Documented functions and methods of one module, in source order."""
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    src_lines = src.splitlines()
    module = path.stem
    found = []

    def visit(body, owner: str | None):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if not doc or node.name.startswith("__"):
                    continue
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = src_lines[first - 1 : node.end_lineno]
                if not (4 <= len(lines) <= max_lines):
                    continue
                code = textwrap.dedent("\n".join(lines)).rstrip()
                if len(code) > max_chars or "\t" in code:
                    continue
                bare = _strip_docstring(lines, node, first - 1)
                found.append(
                    {
                        "module": module,
                        "qual": f"{owner}.{node.name}" if owner else node.name,
                        "sig": _signature(node),
                        "summary": _summary(doc),
                        "doc": doc.strip(),
                        "code": code,
                        "bare": textwrap.dedent("\n".join(bare)).rstrip(),
                    }
                )

    visit(tree.body, None)
    return found


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


def build_conversations(functions: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    by_module: dict[str, list[dict]] = {}
    for f in functions:
        by_module.setdefault(f["module"], []).append(f)

    convs = []
    for i, f in enumerate(functions):
        turns = []
        if rng.random() < 0.7:
            turns.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        r = rng.random()
        siblings = [g for g in by_module[f["module"]] if g is not f]
        if r < 0.3:
            kind = "explain"
            turns.append(
                {
                    "role": "user",
                    "content": rng.choice(EXPLAIN_TEMPLATES).format(
                        module=f["module"], code=f["bare"]
                    ),
                }
            )
            turns.append({"role": "assistant", "content": f["doc"]})
        else:
            kind = "write"
            turns.append({"role": "user", "content": rng.choice(WRITE_TEMPLATES).format(**f)})
            turns.append(
                {"role": "assistant", "content": rng.choice(ANSWER_PREFIXES) + _fence(f["code"])}
            )
            if siblings and r > 0.8:
                kind = "multi"
                g = rng.choice(siblings)
                turns.append(
                    {"role": "user", "content": rng.choice(FOLLOWUP_TEMPLATES).format(**g)}
                )
                turns.append(
                    {
                        "role": "assistant",
                        "content": rng.choice(ANSWER_PREFIXES) + _fence(g["code"]),
                    }
                )
        convs.append({"id": f"{f['module']}:{f['qual']}:{i}", "kind": kind, "conversations": turns})
    rng.shuffle(convs)
    return convs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="configs/demo", help="output folder")
    ap.add_argument(
        "--stdlib",
        default=sysconfig.get_paths()["stdlib"],
        help="standard library folder to read (default: this interpreter's)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    args = ap.parse_args(argv)

    stdlib = Path(args.stdlib)
    files = stdlib_files(stdlib)
    functions, manifest_files = [], []
    for path in files:
        data = path.read_bytes()
        manifest_files.append({"name": path.name, "sha256": hashlib.sha256(data).hexdigest()})
        try:
            functions.extend(extract_functions(path))
        except (SyntaxError, UnicodeDecodeError) as e:  # pragma: no cover - stdlib parses
            print(f"skipping {path.name}: {e}", file=sys.stderr)

    convs = build_conversations(functions, args.seed)
    n_held = max(1, round(len(convs) * args.heldout_fraction))
    train, held = convs[:-n_held], convs[-n_held:]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "conversations.jsonl", train)
    write_jsonl(out / "conversations_heldout.jsonl", held)
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": "<stdlib>/*.py (top level)",
        "seed": args.seed,
        "num_functions": len(functions),
        "num_train": len(train),
        "num_heldout": len(held),
        "kinds": {k: sum(c["kind"] == k for c in convs) for k in ("write", "explain", "multi")},
        "files": manifest_files,
    }
    (out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"{len(functions)} functions -> {len(train)} train + {len(held)} held-out "
        f"conversations in {out}"
    )


if __name__ == "__main__":
    main()
