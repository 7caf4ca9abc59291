"""tiercache demo: checkpoint a CPU training run through RAM -> disk -> S3, kill it, resume, branch.

Run it with ``./dev.sh demo`` (or ``python examples/demo.py`` inside the venv). It starts an
embedded S3 server (SeaweedFS on loopback), then:

1. a trainer process checkpoints every 5 steps through all three tiers and is SIGKILLed
   mid-run, right after a version became remote-durable;
2. a fresh process resumes from the newest durable version, read from the fastest tier that
   holds it (disk: the RAM tier died with the trainer; S3 if it committed that version and the
   disk had not yet), and checks that its parameters are bit-exact to an uninterrupted run;
3. it trains on, branches a fine-tune off an earlier step, tags the best version, deletes the
   local disk tier and restores everything from S3 alone;
4. it prints ``tiercache ls`` and ``tiercache log --graph``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import tiercache
from tiercache.testing import LocalS3

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY = 5


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP and its AdamW optimizer, deterministically initialised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training data of one step (a fixed random regression task)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 256, generator=g)
    return x, torch.sin(x)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One optimizer step; returns the loss."""
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """What a trainer checkpoints."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def same_numerics() -> None:
    """Fix the numerics every process of the demo trains under.

    Floating-point sums depend on how a kernel splits its work: a 1-thread and a 2-thread run
    of the same steps differ in the last bits on many CPUs. Bit-exactness to an uninterrupted
    run is only a meaningful claim when both sides compute under the same settings, so the
    trainer and the resuming process (which also recomputes the reference) both call this.
    """
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def trainer(config: Path) -> None:
    """Phase 1 (child process): train and checkpoint until killed."""
    model, opt = make_model()
    cache = tiercache.open(config)
    cache.prepare()  # fault the RAM arena in while training starts, not in the first save
    step = 0
    while True:
        step += 1
        loss = train_step(model, opt, step)
        if step % CHECKPOINT_EVERY == 0:
            h = cache.save(state_of(model, opt, step), step=step, meta={"loss": round(loss, 5)})
            h.future("remote").add_done_callback(
                lambda f, s=step: print(json.dumps({"remote": s}), flush=True) if f.exception() is None else None
            )


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    """Parameters of an uninterrupted run after ``steps`` steps."""
    model, opt = make_model()
    for s in range(1, steps + 1):
        train_step(model, opt, s)
    return {k: v.clone() for k, v in model.state_dict().items()}


def cli(config: Path, *args: str) -> None:
    """Run the tiercache CLI like a user would."""
    print(f"\n$ tiercache {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "tiercache", "--config", str(config), *args], check=True)


def main() -> None:
    """Run the whole demo."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-after", type=int, default=30, help="kill the trainer once this step is remote-durable")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".demo")
    ap.add_argument("--trainer", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    same_numerics()
    if args.trainer:
        trainer(args.trainer)
        return

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print("starting the embedded S3 server (SeaweedFS on 127.0.0.1) ...", flush=True)
    with LocalS3(root=work) as s3:
        os.environ.update(s3.env())
        config = work / "tiercache.toml"
        config.write_text(
            "[ram]\ncapacity = \"256MiB\"\n\n"
            f"[disk]\npath = \"{work / 'disk'}\"\n\n"
            f"[s3]\nurl = \"{s3.url('demo-run')}\"\nendpoint_url = \"{s3.endpoint_url}\"\n\n"
            "[policy]\nname = \"write-through\"\n"
        )
        print(f"config: {config}\n{config.read_text()}")

        # 1. Train in a child process; kill it without warning once a version is remote-durable.
        print(f"1. training in a child process, checkpoint every {CHECKPOINT_EVERY} steps ...", flush=True)
        child = subprocess.Popen(
            [sys.executable, __file__, "--trainer", str(config)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        last_remote = 0
        for line in child.stdout:
            last_remote = json.loads(line)["remote"]
            print(f"   step {last_remote} is durable in S3", flush=True)
            if last_remote >= args.kill_after:
                break
        child.send_signal(signal.SIGKILL)
        child.wait()
        print(f"   trainer SIGKILLed (exit {child.returncode}) after step {last_remote} became remote-durable")

        # 2. A fresh process view: resume from the fastest tier that has the newest durable version.
        print("\n2. resuming in a fresh cache ...", flush=True)
        with tiercache.open(config) as cache:
            head = cache.resolve("main")
            info = next(v for v in cache.versions() if v.id == head)
            print(f"   resuming from main = {head} (step {info.step}), held by: {', '.join(info.tiers)}")
            model, opt = make_model()
            t0 = time.perf_counter()
            restored = cache.restore(head, into={"model": model.state_dict()})
            opt.load_state_dict(restored["optim"])
            reads = {t: s["read"]["total_bytes"] for t, s in cache.stats()["meter"]["tiers"].items() if "read" in s}
            print(f"   restored in {time.perf_counter() - t0:.3f}s; bytes read per tier: {reads}")
            step = restored["step"]
            if step != info.step:
                raise SystemExit(f"demo failed: version {head} of step {info.step} holds step {step}")
            ref = reference_params(step)
            exact = all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
            print(f"   parameters bit-exact to an uninterrupted run of {step} steps: {exact}")
            if not exact:
                raise SystemExit("demo failed: the restored state differs")

            # 3. Train on, branch a fine-tune off an earlier step, tag the best version.
            for s in range(step + 1, step + 11):
                loss = train_step(model, opt, s)
                if s % CHECKPOINT_EVERY == 0:
                    cache.save(state_of(model, opt, s), step=s, meta={"loss": round(loss, 5)})
            cache.flush()
            base = f"main@{CHECKPOINT_EVERY * 2}"
            cache.branch("ft-lr1e-4", base)
            ft = cache.restore("ft-lr1e-4")
            model.load_state_dict(ft["model"])
            opt.load_state_dict(ft["optim"])
            for group in opt.param_groups:
                group["lr"] = 1e-4
            for s in range(ft["step"] + 1, ft["step"] + 11):
                loss = train_step(model, opt, s)
                if s % CHECKPOINT_EVERY == 0:
                    cache.save(state_of(model, opt, s), step=s, branch="ft-lr1e-4", meta={"loss": round(loss, 5)})
            cache.flush()
            best = min(cache.versions(), key=lambda v: v.meta.get("loss", float("inf")))
            cache.tag("best", best.id)
            print(f"\n3. branched ft-lr1e-4 off {base}; tagged best = {best.id[:10]} (loss {best.meta['loss']})")

        # The local disk is gone (a new node): everything still restores from S3 alone.
        shutil.rmtree(work / "disk")
        with tiercache.open(config) as cache:
            state = cache.restore("best")
            print(f"   disk tier deleted; restored 'best' (step {state['step']}) from S3 alone")
            cache.promote("main", to="disk")
            print("   promoted main back onto the local disk")

        cli(config, "ls")
        cli(config, "log", "--graph")
    print("\ndemo finished")


if __name__ == "__main__":
    main()
