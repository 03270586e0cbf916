"""The README's and docs/'s examples run as written.

Every Python block is preceded by one marker: `<!-- runs -->` (executed here, offline, in a fresh namespace with a
temporary working directory) or `<!-- needs: GPU -->`, `<!-- needs: Hub -->`, `<!-- needs: long run -->`,
`<!-- needs: torchrun -->` (not executed). Every command block that names a script under training/, benchmarks/ or
scripts/ must name one that exists, with flags that its `--help` lists (shell scripts: flags written in the script
or accepted by a Python script it runs).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS = "<!-- runs -->"
NOT_RUN = {f"<!-- needs: {what} -->" for what in ("GPU", "Hub", "long run", "torchrun")}
SCRIPT = re.compile(r"(?:training|benchmarks|scripts)/[\w/.-]+\.(?:py|sh)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def blocks(language: str) -> list[tuple[str, str, str]]:
    """(page:line, marker line before the block, code) for every fenced block of `language`."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").split("\n")
        index = 0
        while index < len(lines):
            if lines[index].strip() == f"```{language}":
                end = lines.index("```", index + 1)
                before = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
                found.append((f"{page.relative_to(ROOT)}:{index + 1}", before, "\n".join(lines[index + 1 : end])))
                index = end
            index += 1
    return found


PYTHON_BLOCKS = blocks("python")
RUNNABLE = [(where, code) for where, marker, code in PYTHON_BLOCKS if marker == RUNS]


def test_every_python_block_says_whether_it_runs():
    unmarked = [where for where, marker, _ in PYTHON_BLOCKS if marker != RUNS and marker not in NOT_RUN]
    assert not unmarked, f"Python blocks without a marker ({RUNS} or {sorted(NOT_RUN)}): {unmarked}"
    assert RUNNABLE


@pytest.mark.parametrize("where, code", RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_python_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    exec(compile(code, where, "exec"), {"__name__": "__doc_block__"})  # noqa: S102 (the documented example)


def commands() -> list[tuple[str, str]]:
    """(page:line, command) for every shell command of the bash blocks, continuation lines joined."""
    found = []
    for where, _, code in blocks("bash"):
        for command in code.replace("\\\n", " ").split("\n"):
            command = command.split(" #", 1)[0].strip()
            if command:
                found.append((where, command))
    return found


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
helps = {}
for script in sys.argv[1:]:
    sys.argv, sys.path[0], out = [script, "--help"], script.rsplit("/", 1)[0], io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        pass
    helps[script] = out.getvalue()
print("HELP-JSON" + json.dumps(helps))
"""


@cache
def help_texts(scripts: tuple[str, ...]) -> dict[str, str]:
    """Each Python script's `--help`, from one subprocess that imports torch and transformers once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, *scripts],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout.split("HELP-JSON", 1)
    assert len(output) == 2, result.stderr[-2000:]
    return json.loads(output[1])


def python_scripts_run_by(shell_script: str) -> list[str]:
    return sorted(set(re.findall(r"training/[\w/]+\.py", (ROOT / shell_script).read_text())))


def test_commands_name_scripts_and_flags_that_exist():
    checks = []  # (where, script, flags)
    for where, command in commands():
        words = shlex.split(command)
        for position, word in enumerate(words):
            if not SCRIPT.fullmatch(word):
                continue
            assert (ROOT / word).is_file(), f"{where}: {word} does not exist"
            flags = FLAG.findall(" ".join(words[position + 1 :]))
            flags += [f for w in words[:position] if w.startswith("EXTRA_ARGS=") for f in FLAG.findall(w)]
            checks.append((where, word, flags))
    python = {script for _, script, _ in checks if script.endswith(".py")}
    python |= {run for _, script, _ in checks if script.endswith(".sh") for run in python_scripts_run_by(script)}
    helps = help_texts(tuple(sorted(python)))
    missing = []
    for where, script, flags in checks:
        if script.endswith(".py"):
            texts = [helps[script]]
        else:
            texts = [(ROOT / script).read_text()] + [helps[run] for run in python_scripts_run_by(script)]
        for flag in flags:
            if not any(re.search(re.escape(flag) + r"(?![\w-])", text) for text in texts):
                missing.append(f"{where}: {script} {flag}")
    assert not missing, "flags that no --help lists:\n" + "\n".join(missing)


def test_pages_stay_within_120_columns():
    wide = [f"{p.name}:{i}" for p in PAGES for i, line in enumerate(p.read_text().split("\n"), 1) if len(line) > 120]
    assert not wide, wide


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(
            r"^\[[\w-]+\]: (\S+)$", text, flags=re.MULTILINE
        ):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def documented_config_fields() -> list[tuple[str, str, str]]:
    """(name, stated default, description) of each entry of `VanillaTransformerConfig`'s `Args:` section, written as
    transformers writes its configs' docstrings: `name (`type`, *optional*, defaults to `value`):`."""
    from hf_vanilla_transformer import VanillaTransformerConfig

    args = VanillaTransformerConfig.__doc__.split("\n    Args:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"^        (?=\w+ \()", args, flags=re.MULTILINE)[1:]
    header = re.compile(r"(\w+) \(`[^`]+`(?: or `[^`]+`)?, \*optional\*, defaults to `([^`]+)`\):\n")
    documented = []
    for entry in entries:
        match = header.match(entry)
        assert match, f"an Args entry without its type and default: {entry.splitlines()[0]}"
        documented.append((match[1], match[2], entry[match.end() :]))
    return documented


def test_the_config_docstring_documents_every_field_once_with_its_default_and_values():
    """README and docs/architecture.md send readers there for every field: each of the config's own fields has one
    entry, its default as the class has it, and, for a field of a few named values, each value."""
    import ast
    import dataclasses
    import typing

    from hf_vanilla_transformer import VanillaTransformerConfig

    fields = {field.name: field for field in dataclasses.fields(VanillaTransformerConfig)}
    own = list(VanillaTransformerConfig.__annotations__)
    documented = documented_config_fields()
    names = [name for name, _, _ in documented]
    assert sorted(names) == sorted(own), (set(own) - set(names), set(names) - set(own))
    assert len(set(names)) == len(names), "a field documented twice"
    for name, default, description in documented:
        assert ast.literal_eval(default) == fields[name].default, (name, default, fields[name].default)
        if typing.get_origin(fields[name].type) is typing.Literal:
            unnamed = [value for value in typing.get_args(fields[name].type) if f'"{value}"' not in description]
            assert not unnamed, (name, unnamed)
