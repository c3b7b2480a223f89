"""The README's and the manual's shell blocks run, or say why they cannot (issue 38).

Every ```bash / ```sh / ```shell / ```console block of README.md and docs/*.md either runs here,
each command in a fresh folder holding copies of `plans/` and `planner/specs/` (the paths the
examples name) with the test's own user data directory, and must exit 0; or the line before it
is a marker `<!-- not run: REASON -->` saying why not (a cloud account, minutes of training,
...). A block with neither fails. In a ```console block the lines after a `$ command` are its
output: each shown line must be a line the command really printed (a line ending in `...`: the
start of one; a line `...` stands for lines left out), so the worked example cannot drift.

The other checks of the manual: the spec reference is what docs/gen_spec_reference.py writes from
planner/spec.py, the README's links reach files, and no page names a path of this machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHELL_LANGS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
# shell syntax that a plain argv cannot carry: such a block must be marked
SHELL_SYNTAX = re.compile(r"[|;&<>`]|\$\(|\$\{|\$[A-Z_]")
TOOLS = ("planner", "runner")  # resolved to this environment's own scripts


@dataclass
class Command:
    argv: list[str]
    output: list[str] = field(default_factory=list)  # console blocks: the lines shown


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    body: list[str]
    reason: str | None  # the not-run marker's reason; None = no marker

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks_of(text: str, path: str) -> list[Block]:
    """The shell blocks of one Markdown text, with the marker each carries."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if m["lang"] in SHELL_LANGS:
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            marker = MARKER.match(before.strip())
            out.append(
                Block(
                    path, i + 1, m["lang"], lines[i + 1 : end], marker["reason"] if marker else None
                )
            )
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [
        b
        for f in doc_files()
        for b in blocks_of(f.read_text(encoding="utf-8"), f.relative_to(REPO).as_posix())
    ]


def commands(block: Block) -> list[Command]:
    """The commands of an unmarked block; ValueError says why a line cannot run as one."""
    if block.lang == "console":
        out: list[Command] = []
        for line in block.body:
            if line.startswith("$ "):
                out.append(Command(_argv(line[2:])))
            elif out:
                out[-1].output.append(line)
            elif line.strip():
                raise ValueError(f"output before any '$ ' command: {line!r}")
        return out
    joined, pending = [], ""
    for line in block.body:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return [Command(_argv(line)) for line in joined if line.strip() and not _comment(line)]


def _comment(line: str) -> bool:
    return line.strip().startswith("#")


def _argv(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    text = shlex.join(words)
    if SHELL_SYNTAX.search(line.split(" #", 1)[0]) and SHELL_SYNTAX.search(text):
        raise ValueError(f"shell syntax (pipes, redirections, variables) in {line.strip()!r}")
    if any(w.startswith("[") for w in words if "=" not in w):
        raise ValueError(f"an optional part in brackets (a synopsis) in {line.strip()!r}")
    return words


def _normal(line: str) -> str:
    return " ".join(line.split())


def shown_lines_missing(shown: list[str], printed: str) -> list[str]:
    """The shown output lines the command did not print."""
    real = [_normal(x) for x in printed.splitlines()]
    missing = []
    for line in shown:
        want = _normal(line)
        if not want or want == "...":
            continue
        if want.endswith("...") and want != "...":
            if not any(r.startswith(want[:-3].rstrip()) for r in real):
                missing.append(line)
        elif want not in real:
            missing.append(line)
    return missing


BLOCKS = all_blocks()


def test_the_docs_have_shell_blocks_both_run_and_marked():
    assert any(b.reason is None for b in BLOCKS), "no block runs: the test would check nothing"
    assert any(b.reason for b in BLOCKS)
    assert all(b.reason != "" for b in BLOCKS), [b.name for b in BLOCKS if b.reason == ""]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with the example paths the docs name (plans/, planner/specs/): commands write
    their plans here, never into the checkout."""
    root = tmp_path_factory.mktemp("docs-commands")
    shutil.copytree(REPO / "plans", root / "plans")
    shutil.copytree(REPO / "planner" / "specs", root / "planner" / "specs")
    return root


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.reason is None], ids=lambda b: b.name)
def test_unmarked_block_runs(block: Block, workdir: Path):
    try:
        cmds = commands(block)
    except ValueError as exc:
        pytest.fail(
            f"{block.name}: cannot run ({exc}); rewrite it as plain commands or put "
            "'<!-- not run: REASON -->' on the line before the block"
        )
    assert cmds, f"{block.name}: an empty shell block"
    bindir = Path(sys.executable).parent
    env = dict(os.environ, COLUMNS="120", PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    for cmd in cmds:
        argv = list(cmd.argv)
        if argv[0] in TOOLS:
            argv[0] = str(bindir / argv[0])
        proc = subprocess.run(
            argv, cwd=workdir, capture_output=True, text=True, timeout=300, env=env
        )
        said = proc.stdout + proc.stderr
        assert proc.returncode == 0, (
            f"{block.name}: {shlex.join(cmd.argv)} exited {proc.returncode}:\n{said[-3000:]}"
        )
        missing = shown_lines_missing(cmd.output, proc.stdout + "\n" + proc.stderr)
        assert not missing, (
            f"{block.name}: {shlex.join(cmd.argv)} no longer prints these shown lines:\n"
            + "\n".join(missing)
            + f"\n--- what it printed (update the block from it):\n{said[-6000:]}"
        )


def test_the_block_checks_catch_what_they_should():
    """A block without a marker that cannot run, a marker, and drifted output are all seen."""
    text = (
        "<!-- not run: needs a cloud account -->\n```bash\nsky jobs launch x.yaml\n```\n\n"
        "```bash\nplanner optimize --json > result.json\n```\n\n"
        "```bash\nplanner launch-file plans/x.toml [--bucket NAME]\n```\n\n"
        "```console\n$ planner profiles\nprofile  GB\n...\n```\n"
        "```toml\n[job]\n```\n"
    )
    found = blocks_of(text, "x.md")
    assert [(b.line, b.lang, b.reason) for b in found] == [
        (2, "bash", "needs a cloud account"),
        (6, "bash", None),
        (10, "bash", None),
        (14, "console", None),
    ]
    with pytest.raises(ValueError, match="shell syntax"):
        commands(found[1])
    with pytest.raises(ValueError, match="synopsis"):
        commands(found[2])
    (cmd,) = commands(found[3])
    assert cmd.argv == ["planner", "profiles"] and cmd.output == ["profile  GB", "..."]
    assert shown_lines_missing(cmd.output, "profile   GB\nt4  16\n") == []
    assert shown_lines_missing(["profile  TB"], "profile GB\n") == ["profile  TB"]
    assert shown_lines_missing(["chosen: t4, 1x8 ..."], "chosen: t4, 1x8, fp16\n") == []
    quoted = blocks_of("```bash\nplanner estimate --set 'constraints.profiles=[\"t4\"]'\n```", "y")
    assert commands(quoted[0])[0].argv[-1] == 'constraints.profiles=["t4"]'


def _spec_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_spec_reference", REPO / "docs" / "gen_spec_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_spec_reference_is_generated_from_planner_spec():
    gen = _spec_generator()
    assert (REPO / "docs" / "spec.md").read_text(encoding="utf-8") == gen.render(), (
        "docs/spec.md is stale: python docs/gen_spec_reference.py"
    )


def test_the_spec_reference_lists_every_declared_key():
    import dataclasses

    from planner import spec

    page = _spec_generator().render()
    for section, cls in [*spec.SECTIONS.items(), ("owned", spec.OwnedSpec)]:
        body = page.split(f"## `[{section}]`" if section != "owned" else "## `[[owned]]`")[1]
        body = body.split("\n## ", 1)[0]
        for f in dataclasses.fields(cls):
            if "doc" in f.metadata:
                assert f"| `{f.name}` |" in body, f"[{section}] {f.name} missing"


def test_the_readme_links_reach_files():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"^[a-z]+:", t)]
    assert local, "the README links to no page"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_no_page_names_a_path_of_this_machine():
    home = str(Path.home())
    pattern = re.compile(r"(/work/|/tmp/|/root/|/home/\w+|" + re.escape(home) + r"/)")
    found = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in [*doc_files(), REPO / "CHANGELOG.md", REPO / "mkdocs.yml"]
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)
