"""How many lines a copy of each script must take: the script and every module of this repository it imports,
directly or through another (docs/template.md's table, which tests/test_template.py keeps true).

    python -m tools.copy_size                                          # the table, in Markdown
    python -m tools.copy_size --files distributed.py                   # the files to copy, one a line
    python -m tools.copy_size --files distributed.py --without-safety-net   # those of the lean copy
    python -m tools.copy_size --diff                                   # the lean copy's change, for git apply

    cp --parents $(python -m tools.copy_size --files distributed.py) ../my_project/   # in this repository's root

Lines are physical lines of the files as they are (at the repository's ruff settings, line length 120), comments
and docstrings included; "code" leaves out blank lines, comments and docstrings. The lean copy is distributed.py
with docs/template.md's diff applied (no safety net), and what it imports."""
import argparse
import ast
import io
import shutil
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("dataparallel.py", "distributed.py", "distributed_mp.py", "distributed_apex.py",
           "distributed_gradient_accumulation.py", "distributed_zero.py", "distributed_fsdp.py",
           "distributed_live_recovery.py", "distributed_pipeline.py", "distributed_diloco.py")
PACKAGES = ("utils", "speed", "safety_net")  # the repository's modules a script can import


def _module_files(name: str, root: Path) -> list[Path]:
    """The files that importing the dotted `name` runs: each package's __init__.py on the way, and the module."""
    parts, files = name.split("."), []
    for k in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:k])
        if (base / "__init__.py").exists():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").exists():
            files.append(base.with_suffix(".py"))
    return files


def imported_files(path: Path, root: Path = ROOT) -> list[Path]:
    """Every file of the repository's packages that importing (or running) `path` imports, transitively, sorted."""
    seen, todo = set(), [path]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    for file in _module_files(name, root):
                        if file not in seen:
                            seen.add(file)
                            todo.append(file)
    return sorted(seen)


def lines(path: Path) -> tuple[int, int]:
    """(all lines, code lines) of a Python file: code leaves out blank lines, comments and docstrings."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstrings)
    return len(text.splitlines()), len(code)


def copy_size(script: Path, root: Path = ROOT) -> dict:
    """The script's lines and those of what it imports: {"script", "modules": [names], "imported", "total", ...}."""
    files = imported_files(script, root)
    own, own_code = lines(script)
    sizes = [lines(f) for f in files]
    imported, imported_code = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    return {"script": own, "modules": [str(f.relative_to(root).with_suffix("")).replace("/", ".") for f in files],
            "imported": imported, "total": own + imported, "code": own_code + imported_code}


def page_diff() -> str:
    """docs/template.md's diff that takes the safety net out of distributed.py, as the page has it."""
    page = (ROOT / "docs" / "template.md").read_text()
    return page.split("```diff\n", 1)[1].split("```\n", 1)[0]


def lean_copy(workdir: Path) -> Path:
    """distributed.py with docs/template.md's diff applied, in a copy of utils/ and speed/ under `workdir`."""
    diff = page_diff()
    for package in ("utils", "speed"):
        shutil.copytree(ROOT / package, workdir / package, ignore=shutil.ignore_patterns("__pycache__"))
    (workdir / "distributed.py").write_text((ROOT / "distributed.py").read_text())
    subprocess.run(["git", "apply", "-"], cwd=workdir, input=diff, text=True, check=True, capture_output=True)
    return workdir / "distributed.py"


def table() -> str:
    """The Markdown table of docs/template.md: per script, and the lean copy of distributed.py."""
    rows = ["| copy | the script | what it imports of this repository | lines in all (code) |", "|---|---|---|---|"]

    def row(name: str, size: dict) -> str:
        modules = ", ".join(f"`{m}`" for m in size["modules"] if not m.endswith("__init__"))
        return f"| {name} | {size['script']} | {size['imported']}: {modules} | {size['total']:,} ({size['code']:,}) |"

    for script in SCRIPTS:
        rows.append(row(f"`{script}`", copy_size(ROOT / script)))
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(row("`distributed.py` [without the safety net](#without-the-safety-net)",
                        copy_size(lean_copy(Path(tmp)), Path(tmp))))
    return "\n".join(rows) + "\n"


def files(script: str, without_safety_net: bool = False) -> list[str]:
    """The files a copy of `script` takes, relative to the repository's root, one for each: the script first, then
    every file of utils/, speed/ and safety_net/ it imports (their __init__.py included), sorted. Without the safety
    net (distributed.py only): what the script imports once docs/template.md's diff is applied."""
    if not without_safety_net:
        return [script] + [str(f.relative_to(ROOT)) for f in imported_files(ROOT / script)]
    with tempfile.TemporaryDirectory() as tmp:
        lean = lean_copy(Path(tmp))
        return [script] + [str(f.relative_to(tmp)) for f in imported_files(lean, Path(tmp))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.copy_size", description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", choices=SCRIPTS, metavar="SCRIPT",
                        help="print the files a copy of SCRIPT takes, one a line, relative to the repository's root "
                             "(for cp --parents), instead of the table; SCRIPT: " + ", ".join(SCRIPTS))
    parser.add_argument("--without-safety-net", action="store_true",
                        help="with --files distributed.py: the files of the copy without the safety net "
                             "(docs/template.md's diff applied)")
    parser.add_argument("--diff", action="store_true",
                        help="print docs/template.md's diff that takes the safety net out of distributed.py "
                             "(for git apply in the copy)")
    args = parser.parse_args(argv)
    if args.without_safety_net and args.files != "distributed.py":
        parser.error("--without-safety-net goes with --files distributed.py (the page's diff is for distributed.py)")
    if args.diff and args.files:
        parser.error("--diff and --files print different things: give one of them")
    if args.diff:
        sys.stdout.write(page_diff())
    elif args.files:
        sys.stdout.write("".join(f"{name}\n" for name in files(args.files, args.without_safety_net)))
    else:
        sys.stdout.write(table())


if __name__ == "__main__":
    main()
