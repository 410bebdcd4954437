"""The documentation is run, so a doc that drifts from the code fails: every code block of README.md and docs/*.md
that talks to a server runs against one real stack (`tritonllm serve`, the default model), its documented
addresses rewritten to the stack's; a block's shown output is checked; README's options table lists exactly the
options `tritonllm serve` has; every relative link and every path the docs name exists.

How a block is checked is declared by its fence language (anything else is refused):
- ```bash and ```python run (bash with `set -euo pipefail` and a curl that fails on HTTP errors; python in a
  subprocess) and must exit 0;
- ```text right after a run block is that block's output: stdout must match it, `…` standing for any text and a
  run of whitespace for any whitespace;
- ```console is never run (starting servers, Docker, kubectl, benchmarks).
A block that is not run is preceded by `<!-- not run: <reason> -->` (required for console, and the only way to
keep a bash or python block from running)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lora_helpers import write_random_adapter
from stack_helpers import REPO_ROOT, running_stack


DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINKED_FILES = [*DOC_FILES, REPO_ROOT / "ARCHITECTURE.md", REPO_ROOT / "bench" / "RESULTS.md"]
RUN_LANGUAGES = {"bash", "python"}
OUTPUT_LANGUAGE = "text"
NOT_RUN_LANGUAGE = "console"
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")
# The addresses the docs use (`make serve`'s defaults) → the test stack's, by role.
DOCUMENTED_ADDRESSES = {"127.0.0.1:9000": "adapter", "127.0.0.1:8000": "http", "127.0.0.1:8001": "grpc",
                        "127.0.0.1:8002": "metrics"}
# The adapters the docs' LoRA examples name.
DOC_LORA_ADAPTERS = ("sql-expert", "team/summarizer")
BLOCK_TIMEOUT_S = 300  # seconds on an idle host; minutes on a busy 2-core one
# bash blocks: fail on the first failing command, and curl fails on an HTTP error status (the docs' curl lines
# stay plain; an error answer still prints its body).
BASH_PRELUDE = "set -euo pipefail\ncurl() { command curl --fail-with-body \"$@\"; }\n"


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason, from a preceding <!-- not run: ... -->
    output: str | None = None  # the ```text block right after it

    @property
    def id(self) -> str:
        return f"{os.path.relpath(self.path, REPO_ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file; a ```text block right after a run block becomes its output."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), None)
        assert end is not None, f"{path}:{index + 1}: unclosed code block"
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = NOT_RUN.fullmatch(previous.strip())
        block = Block(path, index + 1, fence.group(1), "\n".join(lines[index + 1:end]) + "\n",
                      marker.group(1) if marker else None)
        follows_block = bool(blocks) and previous.startswith("```")
        if (block.language == OUTPUT_LANGUAGE and follows_block and blocks[-1].language in RUN_LANGUAGES
                and blocks[-1].output is None):
            blocks[-1].output = block.code
        blocks.append(block)
        index = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in parse_blocks(path)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.language in RUN_LANGUAGES and block.not_run is None]


def convention_errors(blocks: list[Block]) -> list[str]:
    errors = []
    outputs = [block.output for block in blocks if block.output is not None]
    for block in blocks:
        if block.language in RUN_LANGUAGES:
            continue
        if block.language == NOT_RUN_LANGUAGE:
            if block.not_run is None:
                errors.append(f"{block.id}: a console block needs <!-- not run: <reason> --> before it")
        elif block.language == OUTPUT_LANGUAGE:
            if block.code not in outputs or block.not_run is not None:
                errors.append(f"{block.id}: a text block must come right after the bash or python block it is "
                              "the output of")
        else:
            errors.append(f"{block.id}: fence language {block.language!r}: use bash or python (run), text (the "
                          "output of the block before), or console (not run)")
    return errors


def test_every_block_declares_how_it_is_checked():
    assert convention_errors(ALL_BLOCKS) == []
    assert len(RUN_BLOCKS) >= 10  # the parser found the docs' examples


def test_the_conventions_are_enforced(tmp_path):
    """The check above catches each way a block can escape being run."""
    doc = tmp_path / "doc.md"
    doc.write_text("```console\nmake serve\n```\n\n```sh\ncurl x\n```\n\n```text\norphan\n```\n\n```\nbare\n```\n\n"
                   "<!-- not run: a reason -->\n```python\nprint(1)\n```\n\n```text\n1\n```\n")
    blocks = parse_blocks(doc)
    assert [block.not_run for block in blocks] == [None, None, None, None, "a reason", None]
    assert blocks[4].output == "1\n"
    errors = convention_errors(blocks)
    assert len(errors) == 4 and "console" in errors[0] and "'sh'" in errors[1] and "text block" in errors[2] \
        and "''" in errors[3]


def output_pattern(expected: str) -> re.Pattern:
    """The shown output as a pattern: `…` is any text (newlines too), a run of whitespace any whitespace."""
    parts = []
    for piece in re.split(r"(…|\s+)", expected.strip()):
        parts.append(".*?" if piece == "…" else r"\s+" if piece.isspace() else re.escape(piece))
    return re.compile("".join(parts), re.DOTALL)


def test_output_pattern():
    pattern = output_pattern("0 call_… get_weather ''\n…")
    assert pattern.fullmatch("0 call_ab12 get_weather ''\n0 None None '{\"city'")
    assert not pattern.fullmatch("0 call_ab12 get_weather 'x'")
    assert output_pattern("[504,3575]").fullmatch("[504, 3575]") is None  # whitespace only where shown
    assert output_pattern("a b").fullmatch("a\n b")


@pytest.fixture(scope="module")
def docs_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The server the docs talk to: `make serve`'s defaults, plus the adapters the LoRA examples name; int4
    weights asked for (what `auto` picked for the default model on every host measured), since timing each format
    at load takes minutes on a busy 2-core host."""
    lora_dir = tmp_path_factory.mktemp("docs-lora")
    for seed, name in enumerate(DOC_LORA_ADAPTERS, start=1):
        write_random_adapter(lora_dir / name, default_model_dir, seed=seed)
    with running_stack(default_model_dir, tmp_path_factory.mktemp("docs-stack"), "--weight-format", "int4",
                       "--lora-dir", str(lora_dir), "--allow-runtime-lora", "true", lora_dir=lora_dir) as process:
        yield process.stack


def with_stack_addresses(code: str, stack) -> str:
    actual = {"adapter": stack.base_url.removeprefix("http://").removesuffix("/v1"), "http": stack.http_url,
              "grpc": stack.grpc_url, "metrics": stack.metrics_url.removeprefix("http://").removesuffix("/metrics")}
    unknown = set(re.findall(r"(?:127\.0\.0\.1|localhost):\d+", code)) - set(DOCUMENTED_ADDRESSES)
    assert not unknown, f"addresses the test cannot map to its stack: {unknown}"
    for documented, role in DOCUMENTED_ADDRESSES.items():
        code = code.replace(documented, actual[role])
    return code


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.id for block in RUN_BLOCKS])
def test_block_runs_against_the_stack(block: Block, docs_stack, tmp_path):
    assert docs_stack.model_name == "SmolLM2-135M-Instruct"  # the name the docs use
    code = with_stack_addresses(block.code, docs_stack)
    command = ["bash", "-c", BASH_PRELUDE + code] if block.language == "bash" else [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    if block.output is not None:
        assert output_pattern(block.output).fullmatch(result.stdout.strip()), \
            f"{block.id}: output\n{result.stdout}\ndoes not have the documented shape\n{block.output}"


# --- README's options table ------------------------------------------------------------------------------------

def serve_options() -> set[str]:
    """The options `tritonllm serve --help` lists (its usage lines)."""
    result = subprocess.run([sys.executable, "-m", "tritonllm", "serve", "--help"], capture_output=True, text=True,
                            check=True, cwd=REPO_ROOT)
    usage = result.stdout.split("\noptions:")[0]
    return set(re.findall(r"\[(--[a-z0-9-]+)", usage)) - {"--help"}


def readme_options_table() -> set[str]:
    section = re.search(r"^## Options\n(.*?)^## ", (REPO_ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Options' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("| `--")]
    return {option for row in rows for option in re.findall(r"`(--[a-z0-9-]+)`", row.split("|")[1])}


def test_readme_options_table_is_tritonllm_serve_options():
    table = readme_options_table()
    assert sorted(serve_options() - table) == [], "options missing from README's table"
    assert sorted(table - serve_options()) == [], "README's table lists options serve does not have"


# --- links and paths -------------------------------------------------------------------------------------------

def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def link_errors(path: Path, root: Path = REPO_ROOT) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    errors = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            errors.append(f"{path.relative_to(root)}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            errors.append(f"{path.relative_to(root)}: {target}: no such heading")
    return errors


def test_links_lead_somewhere():
    assert [error for path in LINKED_FILES for error in link_errors(path)] == []


def test_link_check_catches_dead_links(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n## Deploying things\n\n[a](#deploying) [b](#deploying-things) [c](missing.md) "
                   "[d](doc.md#title) [e](https://example.com/x.md)\n")
    assert [error.split(": ")[1] for error in link_errors(doc, tmp_path)] == ["#deploying", "missing.md"]


def named_paths(path: Path) -> set[str]:
    """The repository paths a doc names in backticks (`tritonllm/...`, `tests/...`, `bench/...`, ...)."""
    return set(re.findall(r"`((?:tritonllm|tests|bench|deploy|docs|examples)/[\w./-]*)`", path.read_text()))


def git_ignored(paths: list[str]) -> set[str]:
    """Those of `paths` git ignores: files the user writes (e.g. a key), not part of the repository."""
    result = subprocess.run(["git", "check-ignore", "--stdin"], input="\n".join(paths), capture_output=True,
                            text=True, cwd=REPO_ROOT)
    return set(result.stdout.split())


def test_paths_named_in_the_docs_exist():
    missing = {named: path for path in LINKED_FILES for named in named_paths(path) if not (REPO_ROOT / named).exists()}
    ignored = git_ignored(list(missing))
    assert [f"{path.relative_to(REPO_ROOT)}: {named}" for named, path in missing.items()
            if named not in ignored] == []


def test_every_source_file_the_docs_name_exists():
    """The docs name modules by their file name alone (`core_loop.py`, `attention.c`) inside a package's list; a
    file renamed or gone fails here."""
    files = {path.name for folder in ("tritonllm", "tests", "bench", "examples") for path in (REPO_ROOT / folder).rglob("*")}
    named = {f"{path.relative_to(REPO_ROOT)}: {name}" for path in LINKED_FILES
             for name in re.findall(r"`(?:[\w/]+/)?(\w+\.(?:py|c|h))`", path.read_text()) if name not in files}
    assert sorted(named) == []
