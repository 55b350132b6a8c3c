"""The docs cannot drift from the CLIs: every shell example in README.md and docs/*.md names a
subcommand and flags that exist, in their current spelling, and the cheap ones run.

A command is found wherever it stands in a shell block: `uv run qwentitan-launch ...`,
`.venv-trn2/bin/qwentitan-launch ...`, `qwentitan-ckpt ...`, or a nox session that hands its
arguments to one (`nox -s train -- ARGS` is `qwentitan-launch train ARGS`). Its options are
checked against the parser the CLI itself builds; an option that is not the first long name of
its flag is a deprecated alias (`--ranks` for `--ranks-per-node`), which no example may use.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qwentitan.checkpoint.cli import build_parser as ckpt_parser
from qwentitan.launch.launcher import cli as launch_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# nox sessions that hand their arguments to a qwentitan-launch subcommand (noxfile.py).
NOX_TO_LAUNCH = {"train": "train", "pilot": "pilot", "train_trn2": "run"}
# train_trn2's own flags, taken out before the rest reaches `qwentitan-launch run`.
TRN2_VALUED = ("--neuron-venv", "--env", "--shadow")
TRN2_SWITCHES = ("--stand-in", "--install-only")


@dataclass(frozen=True)
class Example:
    doc: str
    line: str
    cli: str  # "qwentitan-launch" or "qwentitan-ckpt"
    argv: tuple[str, ...]  # subcommand first
    via_trn2: bool = False

    def __str__(self) -> str:
        return f"{self.doc}: {self.line}"


def _commands(block: str) -> Iterator[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        yield from (part.strip() for part in re.split(r"&&|\|\||;|\|", line) if part.strip())


def _words(command: str) -> list[str]:
    command = re.sub(r"(^|\s)#.*", "", command)  # a comment, not a `#` inside a word
    try:
        return shlex.split(command)
    except ValueError:  # an apostrophe in prose after the command: words are enough
        return command.split()


def _without_trn2_flags(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in TRN2_VALUED:
            skip = True
        elif arg not in TRN2_SWITCHES and not arg.startswith(tuple(f + "=" for f in TRN2_VALUED)):
            out.append(arg)
    return out


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        for match in FENCE.finditer(doc.read_text()):
            for command in _commands(match.group(2)):
                words = _words(command)
                for i, word in enumerate(words):
                    tool = Path(word).name
                    if tool in ("qwentitan-launch", "qwentitan-ckpt") and i + 1 < len(words):
                        found.append(Example(name, command, tool, tuple(words[i + 1 :])))
                        break
                    if tool == "nox" and words[i + 1 : i + 2] == ["-s"] and i + 2 < len(words):
                        session = words[i + 2]
                        rest = words[i + 3 :]
                        args = rest[1:] if rest[:1] == ["--"] else []
                        if session in NOX_TO_LAUNCH:
                            via = session == "train_trn2"
                            args = _without_trn2_flags(args) if via else args
                            sub = NOX_TO_LAUNCH[session]
                            found.append(
                                Example(name, command, "qwentitan-launch", (sub, *args), via)
                            )
                        break
    return found


def nox_sessions() -> set[str]:
    """Session names declared in noxfile.py, read from its source (nox need not be installed)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    names = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if "nox.session" not in ast.unparse(decorator):
                continue
            names.add(node.name)
            for keyword in getattr(decorator, "keywords", []):
                if keyword.arg == "name":
                    text = ast.unparse(keyword.value)
                    for constant, value in constants.items():
                        text = text.replace("{" + constant + "}", str(value))
                    names.add(text.strip("f'\""))
    return names


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError(f"{parser.prog} has no subcommands")


PARSERS = {
    "qwentitan-launch": _subparsers(launch_cli.build_parser()),
    "qwentitan-ckpt": _subparsers(ckpt_parser()),
}


def problems(example: Example) -> list[str]:
    """What is wrong with one example: an unknown subcommand, unknown flags, deprecated ones."""
    sub, *args = example.argv
    parser = PARSERS[example.cli].get(sub)
    if parser is None:
        return [f"{example.cli} has no subcommand {sub!r}"]
    found = []
    options = parser._option_string_actions
    for arg in args:
        if arg == "--":
            break  # torchtitan's overrides follow
        if not arg.startswith("-") or re.fullmatch(r"-\d.*", arg):
            continue
        flag = arg.split("=", 1)[0]
        action = options.get(flag)
        if action is None:
            found.append(f"{example.cli} {sub} has no option {flag}")
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if flag.startswith("--") and longs and flag != longs[0]:
            found.append(f"{flag} is a deprecated spelling of {longs[0]}")
    return found


EXAMPLES = examples()


def test_the_docs_hold_examples_of_both_clis():
    clis = {example.cli for example in EXAMPLES}
    assert clis == {"qwentitan-launch", "qwentitan-ckpt"}, clis
    assert len(EXAMPLES) >= 20, [str(e) for e in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_each_example_names_a_subcommand_and_flags_that_exist(example):
    assert problems(example) == [], str(example)


def test_an_alias_or_an_unknown_flag_is_found():
    """The checker itself: it must catch what it is for."""
    old = Example("x", "x", "qwentitan-launch", ("train", "--ranks", "4", "--nnodes", "2"))
    bad = Example("x", "x", "qwentitan-launch", ("plan", "--recipe", "r", "--no-such-flag"))
    ckpt = Example("x", "x", "qwentitan-ckpt", ("to-safetensors", "a", "b"))
    assert problems(old) == [
        "--ranks is a deprecated spelling of --ranks-per-node",
        "--nnodes is a deprecated spelling of --nodes",
    ]
    assert problems(bad) == ["qwentitan-launch plan has no option --no-such-flag"]
    assert problems(ckpt) == ["qwentitan-ckpt has no subcommand 'to-safetensors'"]


def test_every_nox_session_the_docs_name_exists():
    named = set()
    for doc in [*DOCS, ROOT / "CONTRIBUTING.md"]:
        for match in FENCE.finditer(doc.read_text()):
            for command in _commands(match.group(2)):
                words = _words(command)
                if "nox" in words and "-s" in words:
                    for word in words[words.index("-s") + 1 :]:
                        if word.startswith("-"):
                            break
                        named.add(word.split("(")[0])
    assert named, "no nox session found in the docs"
    assert named - nox_sessions() == set()


def test_every_flag_of_every_command_is_in_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = set()
    for cli, subs in PARSERS.items():
        for sub, parser in subs.items():
            for action in parser._actions:
                longs = [o for o in action.option_strings if o.startswith("--")]
                if action.help == argparse.SUPPRESS or not longs or longs[0] == "--help":
                    continue
                if f"`{longs[0]}" not in page:
                    missing.add(f"{cli} {sub} {longs[0]}")
    assert missing == set()


def _cheap(example: Example) -> list[str] | None:
    """The argv of an example that runs in a moment here: a plan, `--help`, or the trn2 dry run
    (without a Neuron venv, `nox -s train_trn2 -- ... --dry-run` is `run ... --dry-run` as a
    trn2.48xlarge)."""
    sub, *args = example.argv
    if any(re.fullmatch(r"[A-Z_]+|<.*>|\.\.\.", a) for a in args):
        return None  # a placeholder (R, DIR, <name>), not a runnable value
    if "--help" in args:
        return [sub, "--help"]
    if sub == "plan":
        return [sub, *args]
    if example.via_trn2 and "--dry-run" in args:
        instance = [] if "--instance" in args else ["--instance", "trn2.48xlarge"]
        return [sub, *args, *instance]
    return None


CHEAP = [(example, argv) for example in EXAMPLES if (argv := _cheap(example))]


def test_some_examples_are_cheap_enough_to_run():
    assert any(argv[0] == "plan" for _, argv in CHEAP)
    assert any(example.via_trn2 for example, _ in CHEAP)


@pytest.mark.parametrize(("example", "argv"), CHEAP, ids=[str(e) for e, _ in CHEAP])
def test_the_cheap_examples_run(example, argv, capsys):
    try:
        code = launch_cli.main(argv)
    except SystemExit as exit_:  # --help
        code = exit_.code
    out = capsys.readouterr()
    assert code == 0, f"{example}\n{out.err}"
    assert out.out.strip(), example


PACKAGES = ("kernels", "modeling", "checkpoint", "launch")


def readme_api(package: str) -> set[str]:
    """The names a package README's "Public API" table lists: each row's first cell opens with
    the name in backticks (`to_dcp(src, dst)`, `Flavor`)."""
    text = (ROOT / "packages" / package / "README.md").read_text()
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)", section, re.MULTILINE))


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_exports_exactly_what_its_readme_lists(package):
    module = __import__(f"qwentitan.{package}", fromlist=["__all__"])
    assert readme_api(package) == set(module.__all__)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_readme_is_short(package):
    assert len((ROOT / "packages" / package / "README.md").read_text()) <= 8000


def test_the_readme_is_a_guide_not_a_notebook():
    assert len((ROOT / "README.md").read_text()) <= 15000


def test_every_qwentitan_variable_is_in_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    read = set()
    for source in [
        *(ROOT / "packages").rglob("*.py"),
        ROOT / "noxfile.py",
        *(ROOT / "scripts").iterdir(),
    ]:
        if source.is_file():
            read |= set(re.findall(r"QWENTITAN_[A-Z0-9_]+", source.read_text(errors="replace")))
    assert read, "no QWENTITAN_ variable found"
    assert {name for name in read if f"`{name}`" not in page} == set()
