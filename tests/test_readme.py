"""The README and docs/ are the contract: every snippet in them runs in this suite as written.

- ```python blocks are executed, each on its own, in an empty working directory (the environment is
  put back afterwards). The ones that need S3 start their own server with tiercache.testing.LocalS3.
- ```toml blocks are tiercache configs: each loads with load_config, and its policy with its params.
- ```bash blocks are CLI sessions: each line is a `tiercache ...` command, run in order through the
  CLI against a small disk cache in the working directory (./tiercache.toml), and must succeed.
- ```text blocks are output and tables: not run.

A block that cannot run here (it needs several ranks, or it is this very suite) is preceded by an
HTML comment `<!-- not run: REASON -->`; the reasons are checked below and kept few.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app
from tiercache.config import PolicyConfig, load_config
from tiercache.policy.builtin import load_policy

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"(?:^<!--\s*(?P<marker>[^\n]*?)\s*-->\n)?^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)
NOT_RUN = "not run: "


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a document."""

    path: Path
    line: int
    lang: str
    body: str
    marker: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return not self.marker.startswith(NOT_RUN)


def _snippets() -> list[Snippet]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            out.append(Snippet(path, line, m.group("lang"), m.group("body"), m.group("marker") or ""))
    return out


SNIPPETS = _snippets()


def _of(lang: str) -> list[Snippet]:
    return [s for s in SNIPPETS if s.lang == lang and s.runs]


def _ids(snippets: list[Snippet]) -> list[str]:
    return [s.where for s in snippets]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working directory, no TIERCACHE_* variables, and the environment put back afterwards."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("TIERCACHE_")]:
        monkeypatch.delenv(key)
    # Processes a snippet starts run this checkout's tiercache, whatever is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def _exec(snippet: Snippet) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(snippet.body, snippet.where, "exec"), namespace)
    return namespace


# ------------------------------------------------------------------------------------- the documents


def test_the_readme_is_a_short_guide_with_working_links() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 350
    for path in DOCS:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            doc = (path.parent / file).resolve() if file else path
            assert doc.is_file(), f"{path.name}: link to missing {target}"
            if anchor:
                assert anchor in _anchors(doc.read_text()), f"{path.name}: link to missing anchor {target}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_every_block_is_run_or_says_why_not() -> None:
    assert {s.lang for s in SNIPPETS} <= {"python", "toml", "bash", "text"}, {s.lang for s in SNIPPETS}
    skipped = [s for s in SNIPPETS if not s.runs]
    for s in skipped:
        assert len(s.marker) > len(NOT_RUN) + 20, f"{s.where}: say why it is not run"
    # Kept few on purpose: the set-up commands (this suite, and the demo run below) and the multi-rank
    # examples (tests/test_multirank.py runs those calls on gloo ranks; tests/test_agent_torchrun.py
    # launches the torchrun one).
    assert [(s.path.name, s.body.splitlines()[0]) for s in skipped] == [
        ("README.md", "./dev.sh demo     # train, checkpoint through RAM -> disk -> local S3, SIGKILL, resume, branch"),
        ("README.md", 'dist.init_process_group("nccl")'),
        ("agent.md", "import os, signal"),
    ]
    assert len(_of("python")) >= 7 and len(_of("toml")) >= 5 and len(_of("bash")) >= 1


def test_the_readme_cli_section_names_every_command() -> None:
    readme = (ROOT / "README.md").read_text()
    cli = readme[readme.index("## CLI"):readme.index("## Config")]
    for command in app.registered_commands:
        assert re.search(rf"(tiercache |`){command.name}\b", cli), command.name


# ------------------------------------------------------------------------------------- python blocks


@pytest.mark.parametrize("snippet", _of("python"), ids=_ids(_of("python")))
def test_python_snippet_runs(snippet: Snippet, sandbox: Path) -> None:
    namespace = _exec(snippet)
    assert namespace  # it ran to the end; what it computes is checked by the tests of that feature


def test_the_quickstart_resumes_where_it_stopped(sandbox: Path) -> None:
    quickstart = _of("python")[0]
    assert quickstart.path.name == "README.md" and "for step in range(start, 100):" in quickstart.body
    first = _exec(quickstart)
    assert (first["start"], first["step"]) == (0, 99)
    second = _exec(quickstart)
    with tiercache.open({"disk": {"path": "checkpoints"}}) as cache:
        steps = [v.step for v in cache.versions()]
        saved = cache.restore("main")
    # The second run resumed after the newest saved version (step 90) and saved nothing new.
    assert (saved["step"], second["start"], second["step"]) == (90, 91, 99)
    # Every kept version is one the loop saved; the first and the newest always are. (The default
    # policy may coalesce saves made faster than the disk is measured: only these two are certain.)
    assert {0, 90} <= set(steps) <= set(range(0, 100, 10))


# --------------------------------------------------------------------------------------- toml blocks


@pytest.mark.parametrize("snippet", _of("toml"), ids=_ids(_of("toml")))
def test_toml_snippet_is_a_valid_config(snippet: Snippet) -> None:
    cfg = load_config(tomllib.loads(snippet.body), env={})
    policy = load_policy(cfg.policy)
    assert callable(policy.place) and callable(policy.evict) and callable(policy.on_full)


def test_the_config_reference_loads() -> None:
    [reference] = [s for s in _of("toml") if s.path.name == "config.md"]
    data = tomllib.loads(reference.body)  # (tests/test_config_doc.py checks it field by field against the model)
    cfg = load_config(data, env={})
    assert cfg.ram is not None and cfg.ram.capacity == 4 << 30
    assert cfg.s3 is not None and (cfg.s3.bucket, cfg.s3.prefix) == ("bucket", "prefix")


def test_every_shipped_preset_loads() -> None:
    presets = sorted(p.stem for p in (ROOT / "policies").glob("*.toml"))
    assert presets == ["keep-best", "slow-s3", "throughput-adaptive", "write-through"]
    for name in presets:
        policy = load_policy(PolicyConfig(name=name))
        assert callable(policy.place) and callable(policy.evict) and callable(policy.on_full)


# --------------------------------------------------------------------------------------- bash blocks


@pytest.mark.parametrize("snippet", _of("bash"), ids=_ids(_of("bash")))
def test_cli_snippet_runs(snippet: Snippet, sandbox: Path) -> None:
    (sandbox / "tiercache.toml").write_text('[disk]\npath = "store"\n')
    with tiercache.open(None) as cache:
        for step in (100, 200, 300):
            cache.save({"w": torch.full((256,), float(step))}, step=step).wait("local")
    commands = [shlex.split(line, comments=True) for line in snippet.body.splitlines()]
    commands = [c for c in commands if c]
    assert commands and all(c[0] == "tiercache" for c in commands), f"{snippet.where}: only tiercache commands run"
    for command in commands:
        result = CliRunner().invoke(app, command[1:])
        assert result.exit_code == 0, f"{shlex.join(command)}: {result.output}"


# ------------------------------------------------------------------------------------------ the demo


def test_the_demo_resumes_bit_exact_from_the_version_it_names(tmp_path: Path) -> None:
    # What `./dev.sh demo` runs (the set-up step aside), with an earlier kill to keep it short.
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--kill-after", "10",
                          "--workdir", str(tmp_path / "demo")], capture_output=True, text=True, check=False,
                         timeout=240)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    # The version main points at after the kill: the one acknowledged in S3, or a newer one. Each
    # tier commits a version on its own: the disk usually first, but a loaded machine's fsyncs may
    # let S3 commit the newest version first, which only S3 holds then.
    [(version, step, tiers)] = re.findall(r"resuming from main = (\w{26}) \(step (\d+)\), held by: ([a-z0-9, ]+)\n",
                                      ran.stdout)
    [exact] = re.findall(r"parameters bit-exact to an uninterrupted run of (\d+) steps: True", ran.stdout)
    assert exact == step and int(step) >= 10 and tiers.split(", ") in (["disk"], ["s3"], ["disk", "s3"]), tiers
    # It is read from the fastest tier that holds it: the disk alone if it does.
    [reads] = re.findall(r"bytes read per tier: (\{.*\})\n", ran.stdout)
    read_from = set(ast.literal_eval(reads))
    assert (read_from == {"disk"}) if "disk" in tiers.split(", ") else ("s3" in read_from), (tiers, reads)
    # The final `tiercache ls` runs after the disk tier was deleted: it lists the version if S3 held
    # it at the kill (a head left local-only may also have been caught up by the resumed process,
    # unless its own newer saves reached S3 first).
    listed = re.search(rf"\n {version[:10]} +{step} +main ", ran.stdout) is not None
    assert listed or "s3" not in tiers.split(", ")
    assert ran.stdout.rstrip().endswith("demo finished")
