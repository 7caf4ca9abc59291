"""docs/agent.md's torchrun example, run as written: two ranks under torchrun (gloo, CPU), a crash, a restart.

The example's ``train.py`` and ``tiercache.toml`` are taken from the document, written to a fresh
directory and launched twice with ``torchrun --standalone --nproc-per-node 2``: the first launch
fails (rank 1 kills itself after step 3), the second resumes both ranks' parts from node RAM and
saves steps 4 to 6. The launches are two runs of torchrun, not ``--max-restarts``: torchrun's own
restart of gloo workers can read the previous round's addresses from its shared store and fail to
connect (a race of torch's, not of the example's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tiercache
from tiercache.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- not run: tests/test_agent_torchrun.py"


def _example() -> tuple[str, str, list[str]]:
    """The example's ``train.py``, ``tiercache.toml`` and the output lines the document shows for the restart."""
    text = (ROOT / "docs" / "agent.md").read_text()
    after = text[text.index(MARKER):]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", after, re.M | re.S)
    (py_lang, train), (toml_lang, config), (text_lang, session) = blocks[:3]
    assert (py_lang, toml_lang, text_lang) == ("python", "toml", "text")
    shown = [line for line in session.splitlines() if line.startswith("rank ")]
    return train, config, shown


#: One line the example prints. torchrun runs its ranks with ``python -u``, so a print's text and
#: its newline are two writes to the shared pipe and two ranks' lines can interleave ("rank 0
#: ...rank 1 ...\n\n"): the lines are found in the output, not split from it.
RANK_LINE = re.compile(r"rank \d+ (?:resumed at step \d+ from \[[^\]]*\]|saved step \d+)")


def _launch(work: Path) -> subprocess.CompletedProcess[str]:
    tmp = work / "tmp"  # torchrun's own log directories (torchelastic_*) go here, not to the system's
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "train.py"], cwd=work, env=env, capture_output=True, text=True, timeout=240, check=False)


def test_the_torchrun_example_of_docs_agent_crashes_and_resumes_from_node_ram(tmp_path: Path) -> None:
    train, config, shown = _example()
    work = tmp_path / "job"
    work.mkdir(mode=0o700)
    (work / "train.py").write_text(train)
    (work / "tiercache.toml").write_text(config)
    try:
        first = _launch(work)
        assert first.returncode != 0, first.stdout + first.stderr[-3000:]  # rank 1 was killed after step 3
        second = _launch(work)
        assert second.returncode == 0, second.stdout + second.stderr[-3000:]
        assert sorted(RANK_LINE.findall(second.stdout)) == sorted(shown)
        assert all(RANK_LINE.fullmatch(line) for line in shown)  # (so the pattern reads what the document shows)
    finally:
        subprocess.run([sys.executable, "-m", "tiercache", "agent", "stop"], cwd=work, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=False)
    assert load_config(work / "tiercache.toml").disk.path == Path("ckpt")  # type: ignore[union-attr]
    with tiercache.open({"disk": {"path": str(work / "ckpt")}}) as cache:  # the same store, without the agent
        chain = cache.versions("main")
    assert [v.step for v in chain] == [1, 2, 3, 4, 5, 6]
    assert [v.parent for v in chain] == [None, *(v.id for v in chain[:-1])]
