"""The pages say what this tree does: every command of README.md and docs/*.md parses with its own program's parser (a
CPU training command with the script's parse_args, every check included; a GPU one with its flags alone, the device
checks needing a GPU; a failure program or benchmark stopped at its parser), every relative link of README.md,
docs/*.md and benchmarks/results/ reaches a file and, for a page, a heading, and the sentences an audit found stronger
than the files stay as the files have them. Nothing is launched: a few seconds, most of them importing the scripts."""
import argparse
import importlib
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]  # what a reader reads: the front page and the docs
RESULTS = ROOT / "benchmarks" / "results"
LINKED = [*PAGES, *sorted(RESULTS.glob("**/README.md"))]
SCRIPTS = sorted(p.name for p in ROOT.glob("*.py"))  # the training scripts, each with parse_args(argv)


def read(path: Path) -> str:
    return path.read_text()


def without_code_blocks(text: str) -> str:
    return re.sub(r"^ *```.*?^ *```[^\n]*$", "", text, flags=re.S | re.M)


def without_code(text: str) -> str:
    """The page with its fenced blocks and inline code removed: what is prose, headings and links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def fenced_blocks(text: str) -> list[str]:
    """The page's fenced code blocks, those indented in a list item too."""
    return re.findall(r"^ *```[^\n]*\n(.*?)^ *```", text, flags=re.S | re.M)


STARTS_A_COMMAND = re.compile(r"([A-Z_][A-Z0-9_]*=\S* )*(python3? |torchrun |pip |diff |\. )")
ASSIGNMENT = re.compile(r"([A-Z_][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)")  # COMMON="--device cpu ...", alone on a line


def commands(text: str) -> list[str]:
    """Every command of the page that runs one of this repository's programs (python, torchrun, pip, diff, `. `,
    after the environment it sets). In its code blocks: each line that starts as such a command does, after a
    transcript's `$ ` prompt (the other lines are the programs' output, comments, file trees, or other programs'
    commands: cd, sleep, torchft_lighthouse); a trailing backslash joins the next line, comments are dropped,
    `a && b`, `a | b` and `a & b` are two commands and `$(a)` one of its own, and a block's `NAME="..."` line is
    expanded as `$NAME` in its later lines, as the shell does. And each inline span (one that wraps over a line too)
    that starts as such a command does."""
    found = []
    for block in fenced_blocks(text):
        variables = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s|\s#$", line)[0].strip().removeprefix("$ ")
            if assignment := ASSIGNMENT.fullmatch(line):
                variables[assignment[1]] = shlex.split(assignment[2])[0]
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            substituted = re.findall(r"\$\(([^()]*)\)", line)
            parts = re.split(r"&&|\||&", re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)) + substituted
            found += [part.strip() for part in parts if STARTS_A_COMMAND.match(part.strip())]
    for paragraph in re.split(r"\n\s*\n", without_code_blocks(text)):
        for span in re.findall(r"`([^`]+)`", paragraph):
            span = " ".join(span.split())
            if STARTS_A_COMMAND.match(span):
                found.append(span)
    return found


def words_after_environment(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # CUDA_VISIBLE_DEVICES=0,1 and the like
        words.pop(0)
    return words


def program_and_argv(command: str):
    """(kind, what, argv): ("script", "distributed.py", flags) for a training script however it starts (python,
    torchrun with its own options checked by torchrun's parser), ("torchrun", "torchrun", options) for torchrun's
    options named alone, ("module", "benchmarks.run", flags) for python -m, ("file", "examples/x.py", flags) for
    another python file, or ("other", first word, the rest)."""
    if inline := re.match(r"([A-Z_][A-Z0-9_]*=\S* )*python3? (-c|-)( |$)", command):  # a program on the page
        return "file", inline[2], []
    words = words_after_environment(command)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None:  # `torchrun --max-restarts` in a sentence: the options alone
            return "torchrun", "torchrun", words[1:]
        get_args_parser().parse_args(words[1:at + 1])  # torchrun's own options, as torchrun reads them
        return "script", words[at], words[at + 1:]
    if words[0] in ("python", "python3"):
        if words[1] == "-m":
            return "module", words[2], words[3:]
        return ("script" if words[1] in SCRIPTS else "file"), words[1], words[2:]
    return "other", words[0], words[1:]


# Programs a page starts that are no file of this tree, each with the reason it is not parsed.
NOT_IN_THIS_TREE = {
    "-": "debugging.md's measurement: the page's own snippet (cost.py), read by python from stdin",
    "-c": "template.md's mean and std: a program written out on the page, given to python -c",
    "<script>": "a placeholder for any of the scripts, each of which the pages also name and start on its own",
    "train.py": "template.md's name for the reader's own copy of a script",
}


class Parsed(Exception):
    """Raised by argparse's parse_args (or parse_known_args) once it has parsed: the program stops there, having run
    nothing."""


def parse_with_main(main, argv, monkeypatch) -> argparse.Namespace:
    """main(argv) up to its parse_args (or parse_known_args): the flags are parsed by the program's own parser, and
    nothing runs."""
    original, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_then_stop(parser, args=None, namespace=None):
        inside.append(parser)  # its own parse_known_args runs whole: unrecognised words are then an error
        raise Parsed(original(parser, args, namespace))

    def parse_known_then_stop(parser, args=None, namespace=None):
        if inside:
            return original_known(parser, args, namespace)
        raise Parsed(original_known(parser, args, namespace)[0])

    with monkeypatch.context() as m, pytest.raises(Parsed) as parsed:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_then_stop)
        main(argv)
    return parsed.value.args[0]


def run_file_to_its_parser(relative: str, argv: list[str], monkeypatch) -> None:
    """`python relative argv...` as python runs it (as __main__, its own folder first on the path), stopped at its
    parser: a file whose main takes no argv (failures/: main(rank, world_size, args), the flags parsed under
    `if __name__ == "__main__"`)."""
    monkeypatch.syspath_prepend(str((ROOT / relative).parent))
    monkeypatch.setattr(sys, "argv", [relative, *argv])
    parse_with_main(lambda argv: runpy.run_path(str(ROOT / relative), run_name="__main__"), argv, monkeypatch)


def import_file(relative: str, monkeypatch):
    """The program at `relative` imported as `python relative` runs it: its own folder first on the path."""
    monkeypatch.syspath_prepend(str((ROOT / relative).parent))
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def as_a_user_runs_it(monkeypatch):
    """No launcher's environment (a rank other than local rank 0 would wait 30 s before a parse error), the root as
    the working directory."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_LOCALID", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)


def test_the_readme_is_a_front_page():
    """At most 130 lines, its first training command within the first 40, and no commit hashes or machine history
    (those live in docs/ and benchmarks/results/, one link away)."""
    lines = read(README).splitlines()
    assert len(lines) <= 130
    first = next(i for i, line in enumerate(lines, 1) if re.match(r"\S*(python|torchrun) .*\b(" + "|".join(
        re.escape(s) for s in SCRIPTS) + r")\b", line))
    assert first <= 40, first
    hashes = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", without_code(read(README)))
    assert not hashes and "at commit" not in read(README)


def check_command(command: str, monkeypatch) -> str:
    """One command as written: a training script's flags through that script's parse_args (every check, on the CPU;
    on a GPU only argparse's part, since the rest asks for a visible GPU; --help prints and exits 0), the other
    programs' through their own parser, the files, packages and markers it names present. Returns the program."""
    from utils import flags
    kind, what, argv = program_and_argv(command)
    if what in NOT_IN_THIS_TREE:
        return what
    if kind == "script":
        module = importlib.import_module(what.removesuffix(".py"))
        if "--help" in argv:
            with pytest.raises(SystemExit) as exited:
                module.parse_args(argv)
            assert exited.value.code == 0, command
        elif "--device" in argv and argv[argv.index("--device") + 1] == "cpu":
            args = module.parse_args(argv)  # exits on a bad flag: pytest reports the SystemExit
            assert isinstance(args, argparse.Namespace), command
        else:
            with monkeypatch.context() as m:  # argparse alone: the device checks need the GPU the command names
                m.setattr(flags, "parse", lambda parser, argv=None: parser.parse_args(flags._dashes(argv)))
                args = module.parse_args(argv)
            assert isinstance(args, argparse.Namespace), command
    elif kind == "torchrun":  # its options named in a sentence: each one torchrun has
        from torch.distributed.run import get_args_parser
        known = {option for action in get_args_parser()._actions for option in action.option_strings}
        assert argv and all(word.split("=")[0] in known for word in argv), command
    elif kind == "module" and what == "pytest":
        declared = set(re.findall(r'"(\w+): ', read(ROOT / "pyproject.toml").split("markers = ", 1)[1]))
        if "-m" in argv:
            named = set(re.findall(r"\w+", argv[argv.index("-m") + 1])) - {"not", "and", "or"}
            assert named <= declared, (command, named - declared)
        assert all((ROOT / word).exists() for word in argv if word.startswith("tests/")), command
    elif kind == "module" and (ROOT / (what.replace(".", "/") + ".py")).is_file():  # benchmarks.run, safety_net...
        parse_with_main(importlib.import_module(what).main, argv, monkeypatch)
    elif kind == "module":  # venv, torch.distributed.launch
        assert importlib.util.find_spec(what), command
    elif kind == "file":
        assert (ROOT / what).is_file(), command
        module = import_file(what, monkeypatch)
        if hasattr(module, "parse_args"):
            module.parse_args(argv)
        else:
            run_file_to_its_parser(what, argv, monkeypatch)
    elif what == "diff":
        assert all((ROOT / f).is_file() for f in argv), command
    elif what == "pip":
        if "-r" in argv:
            assert (ROOT / argv[argv.index("-r") + 1]).is_file(), command
        else:  # a package by name: one the requirements list, or Lightning, the optional peer that benchmarks/ imports
            listed = set(re.findall(r"^([\w-]+)", read(ROOT / "requirements-dev.txt") + read(ROOT / "requirements.txt"),
                                    flags=re.M))
            assert "import lightning" in read(ROOT / "benchmarks" / "peers" / "lightning_ddp.py")
            assert argv[0] == "install" and set(argv[1:]) <= listed | {"lightning"}, command
    else:
        assert what == "." and Path(argv[0]).parts[0] == ".venv", command  # . .venv/bin/activate
    return what


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_command_parses(page, as_a_user_runs_it, monkeypatch):
    """Each command of README.md and of every docs/ page that runs one of this repository's programs, as
    check_command checks it; those NOT_IN_THIS_TREE names are left out, each for the reason it gives."""
    found = commands(read(page))
    assert found, page.name
    for command in found:
        check_command(command, monkeypatch)


def test_the_readme_starts_the_main_programs_and_runs_first_on_the_cpu():
    started = {program_and_argv(c)[1] for c in commands(read(README))}
    assert {"distributed_mp.py", "distributed.py", "distributed_apex.py", "benchmarks.run", "pytest"} <= started
    cpu_runs = [c for c in commands(read(README)) if "--device cpu" in c]
    assert cpu_runs, "the README's first run is on the CPU"


def anchors(page: Path) -> set[str]:
    """GitHub's ids of the page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen, ids = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


@pytest.mark.parametrize("page", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(read(page))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        assert destination.exists(), f"{page.name}: {target}"
        if anchor and destination.suffix == ".md":
            assert anchor in anchors(destination), f"{page.name}: {target}"


def sentences(text: str) -> list[str]:
    """The page's sentences, with each table row one of its own."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        rows = [line for line in paragraph.splitlines() if line.lstrip().startswith("|")]
        prose = " ".join(line.strip() for line in paragraph.splitlines() if not line.lstrip().startswith("|"))
        found += rows + re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[])", prose)
    return found


def test_no_clock_is_said_to_hold_the_evaluation():
    """Every epoch's clock stops at its last step (since the clock was moved there, before any figure here was
    measured); the device loader's data set is on the GPU before the clock starts."""
    for page in [*PAGES, *sorted(RESULTS.glob("**/README.md"))]:
        text = " ".join(read(page).split())
        for claim in (r"evaluations?\s+(?:is\s+|are\s+|was\s+|were\s+)?(?:included|inside)",
                      r"\binclud\w*\s+(?:the\s+|its\s+)?evaluations?", r"data and augmentation included"):
            assert not re.search(claim, text, flags=re.I), (page.name, re.search(claim, text, flags=re.I).group())


def test_the_fastest_peer_is_named_with_its_tuning():
    """Wherever a page compares with "the fastest peer", the same sentence says whether that peer was tuned: the GPU's
    3.79x is against the untuned tutorial loop."""
    for page in PAGES:
        for sentence in sentences(read(page)):
            if "fastest peer" in sentence:
                assert "tuned" in sentence, (page.name, sentence)
            if "3.79x" in sentence:
                assert "3.79x the untuned" in sentence, (page.name, sentence)


def test_units_are_said_once_and_kept():
    """MB is 2^20 bytes everywhere (what torch and the benchmarks' tables count), said once, in docs/concepts.md:
    no page mixes in MiB, and ResNet-18's 11.2 M float32 parameters are 43 MB wherever they are counted, not the
    decimal 45. A GFLOP figure is the counted forward and backward pass, 3.33, not a multiply-add count."""
    assert "MB and GB on these pages are 2^20 and 2^30 bytes" in " ".join(read(ROOT / "docs" / "concepts.md").split())
    assert round(11_220_132 * 4 / 2**20) == 43  # ResNet-18 with a 100-class head: its parameters, in MB
    for page in PAGES:
        text = " ".join(read(page).split())
        assert not re.search(r"\d\s*(?:KiB|MiB|GiB)\b", text), page.name
        assert not re.search(r"\b4[45](?:\.\d)? MB (?:per step|of (?:gradients|weights))", text), page.name
        assert set(re.findall(r"([\d.]+) GFLOP", text)) <= {"3.33"}, page.name


def test_not_here_yet_lists_only_what_is_missing():
    """sharding.md's "Not here yet" names neither the ladder (benchmarks/results/cpu-epyc-ladder) nor FSDP's time on
    one GPU (the H200's rows), both measured."""
    assert (RESULTS / "cpu-epyc-ladder" / "sharding.md").is_file()
    assert "FSDP + bfloat16 policy" in read(RESULTS / "gpu-h200" / "rows" / "benchmark.md")
    text = read(ROOT / "docs" / "sharding.md")
    section = text.split("## Not here yet", 1)[1].split("\n## ", 1)[0]
    assert "ladder" not in section and "time per epoch next to DDP" not in section, section


def test_the_tuned_peers_proof_is_stated_as_the_test_makes_it():
    """docs/speed.md says what tests/test_peers.py runs: the peer in one process, uncompiled, float32, one batch of 16
    images without augmentation, with channels-last and the fused SGD; if the test grows, the page must say so."""
    test = read(ROOT / "tests" / "test_peers.py")
    peer = test[test.index('"benchmarks.peers.plain_ddp"'):test.index("cwd=ROOT")]
    assert '"--channels-last", "--fused-sgd"' in peer and '"--batch-size", "16"' in peer
    assert not re.search(r"--compile|--tuned|bfloat16|--workers\", \"[1-9]", peer + test.split("STEPS = ")[1][:120])
    assert '"--no-augment"' in test.split("STEPS = ")[1].splitlines()[0]
    speed = " ".join(read(ROOT / "docs" / "speed.md").split())
    for said in ("one batch of 16 synthetic images without augmentation, float32",
                 "channels-last and fused SGD but not its compilation", "is not checked against ours"):
        assert said in speed, said
    assert "proves it trains our workload" not in speed


def test_the_graph_paths_host_waits_are_where_the_log_has_them():
    """The H200's log prints both of the graph path's waits during epoch 1 (none after its end line): no page says one
    per epoch."""
    log = read(RESULTS / "gpu-h200" / "log.txt").split("===== graph-waits")[1].split("=====")[0]
    before_end, after_end = log.split("\nepoch 1:", 1)
    assert before_end.count("synchronizing CUDA operation") == 2 and "synchronizing" not in after_end
    for page in (ROOT / "docs" / "speed.md", RESULTS / "gpu-h200" / "README.md"):
        text = " ".join(read(page).split())
        assert "both printed during epoch 1" in text and "one per epoch, at its start" not in text, page.name


def test_a_results_folder_says_where_its_run_wrote():
    """A run's log that says it wrote its tables elsewhere than the command its files record: the folder's README says
    so (the tables were copied and the command edited after the run)."""
    for log in sorted(RESULTS.glob("*/log.txt")):
        folder = log.parent
        wrote = set(re.findall(r"^wrote (\S+)/benchmark\.md", read(log), flags=re.M))
        table = read(folder / "benchmark.md").splitlines()[0] if (folder / "benchmark.md").exists() else ""
        recorded = set(re.findall(r"--output-dir '?([^'`\s]+)", table))
        for place in wrote - recorded:
            note = folder / "README.md"
            assert note.is_file() and place in read(note) and "edited after the run" in read(note), (folder.name, place)



def test_the_results_index_lists_every_folder():
    """benchmarks/results/README.md links every folder of results, and no folder that is not there."""
    listed = set(re.findall(r"^\| \[([\w.-]+)\]\(\1/\) \|", read(RESULTS / "README.md"), flags=re.M))
    assert listed == {p.name for p in RESULTS.iterdir() if p.is_dir()}, listed
